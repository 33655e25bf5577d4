"""Ledger files as older broker versions left them, for the migration tests: :func:`schema_1_ledger` writes
``ledger_schema_1.sql`` beside this file, the frozen version-1 schema (before stop / start and attempt rows)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

#: the ledger's tables as schema 1 wrote them, frozen: never derived from the current schema, which moves on
SCHEMA_1 = Path(__file__).with_name("ledger_schema_1.sql")


def schema_1_ledger(path: Path) -> sqlite3.Connection:
    """Create the SQLite file ``path`` with schema 1's tables and ``schema_version`` 1 in ``meta``; returns the
    open connection for the caller's rows (the caller commits and closes it before opening a Ledger there)."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_1.read_text())
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    return db
