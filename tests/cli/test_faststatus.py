"""`broker status`'s parser-free start (broker.cli.faststatus) prints what the full command prints, byte for byte,
and leaves to the full command every case it cannot show the same way.

Each ledger is printed twice by the real console script's entry point, in a pipe: once as users run it, once with
the fast path switched off (the full command: Typer, rich, the pydantic records); stdout, stderr and the exit code
must match.  Whether the fast path took the case is checked in-process (:func:`faststatus._render`)."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from broker.cli import faststatus

#: the full command: the entry point with the fast path refusing everything
_FULL = ("import sys\nfrom broker.cli import faststatus\nfaststatus.run = lambda limit: False\n"
         "from broker.cli.app import main\nmain(sys.argv[1:])")
_T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def _env(home: Path, columns: int = 100) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VAST_", "OCI_", "BROKER_", "FORCE_COLOR", "TTY_", "NO_COLOR"))}
    env.update(BROKER_HOME=str(home), HOME=str(home), COLUMNS=str(columns))
    return env


def _both(home: Path, *args: str, columns: int = 100) -> tuple[tuple, tuple]:
    """(fast, full): (exit code, stdout, stderr) of `broker status ARGS` each way, in a pipe."""
    out = []
    for argv in ([sys.executable, "-m", "broker"], [sys.executable, "-c", _FULL]):
        p = subprocess.run([*argv, "status", *args], env=_env(home, columns), cwd=home, capture_output=True,
                           text=True, timeout=120)
        out.append((p.returncode, p.stdout, p.stderr))
    return out[0], out[1]


class _Out(io.TextIOWrapper):
    """stdout as a pipe (or, ``tty``, a terminal), whatever pytest's own stdout is (``-s`` on a terminal)."""

    def __init__(self, tty: bool = False):
        super().__init__(io.BytesIO(), encoding="utf-8")
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _fast(home: Path, monkeypatch, limit: int = 20, columns: int = 100, tty: bool = False) -> str | None:
    """What the fast path prints in-process for this home, or None when it leaves the case to the full command."""
    for k in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sys, "stdout", _Out(tty))
    monkeypatch.setenv("BROKER_HOME", str(home))
    monkeypatch.setenv("COLUMNS", str(columns))
    try:
        return faststatus._render(limit)
    except faststatus._NotMine:
        return None


def _home(tmp_path: Path, name: str = "home") -> Path:
    home = tmp_path / name
    home.mkdir(mode=0o700)
    return home


def _ledger(home: Path):
    from broker.money.ledger import Ledger

    return Ledger(home / "ledger.sqlite")


def _ended_run(led, i: int, *, status: str = "succeeded", name: str | None = None, provider: str = "vast",
               topology: str = "multi-node", budget: float | None = 5.0, rate: float = 0.5, nodes: int = 2,
               minutes: int = 10) -> str:
    """One ended run written through the product's own ledger calls, with ``nodes`` terminated instances."""
    from broker.core.records import Run

    rid = f"run-{i:04d}"
    c = _T0 + timedelta(minutes=7 * i)
    led.create_run(Run(id=rid, name=name or f"ddp-{i % 5}", provider=provider, topology=topology, status=status,
                       created_at=c, started_at=c + timedelta(seconds=30), ended_at=c + timedelta(minutes=minutes),
                       deadline=c + timedelta(hours=2), budget_usd=budget, exit_codes={"0": 0, "1": None},
                       recipe={"name": name or "ddp"}))
    for k in range(nodes):
        res = led.record_intent(rid, provider, "instance", f"n{k}", usd_per_hour=rate, deadline=c + timedelta(hours=2),
                                attrs={"min_billed_seconds": 60})
        led.mark_created(res.id, f"i-{i}-{k}", state="running")
        led.update_resource(res.id, state="terminated", terminated_at=c + timedelta(minutes=minutes),
                            terminated_by="cli", running_since=c)
        led._db.execute("UPDATE resources SET created_at = ? WHERE id = ?", (c.isoformat(), res.id))
    return rid


def _mixed(home: Path, n: int = 25) -> None:
    led = _ledger(home)
    states = ("succeeded", "failed", "interrupted", "deadline", "torn_down", "succeeded")
    provs = (("vast", "multi-node"), ("local", "local"), ("netns", "multi-node"), ("aws", "aws"),
             ("oci", "any"), ("slurm", "slurm-cluster"))
    for i in range(n):
        p, t = provs[i % len(provs)]
        _ended_run(led, i, status=states[i % len(states)], provider=p, topology=t,
                   name=("a [bold]name[/] with markup" if i == n - 2 else None),
                   budget=None if i % 7 == 3 else (0.01 if i % 5 == 2 else 5.0), rate=0.25 + i % 4,
                   nodes=i % 3, minutes=5 + i)
    led.close()


def _same(home: Path, *args: str, columns: int = 100) -> tuple:
    fast, full = _both(home, *args, columns=columns)
    assert fast == full
    assert full[0] == 0, full
    return full


# ------------------------------------------------------------------------------------------- taken, same output
def test_an_empty_ledger_prints_the_same(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _ledger(home).close()
    full = _same(home)
    assert _fast(home, monkeypatch) == full[1]
    assert "no runs yet" in full[1]


def test_one_run_prints_the_same(tmp_path, monkeypatch):
    home = _home(tmp_path)
    led = _ledger(home)
    _ended_run(led, 1)
    led.close()
    full = _same(home, "-r")
    assert _fast(home, monkeypatch) == full[1]
    assert "run-0001" in full[1] and "$0.17 / $5.00" in full[1]


def test_25_runs_of_mixed_states_print_the_same_at_several_widths(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home)
    full = _same(home, "--no-refresh", columns=200)
    assert _fast(home, monkeypatch, columns=200) == full[1]
    assert "[bold]" in full[1]  # a name's brackets printed as written, as rich's escape does
    natural = len(full[1].splitlines()[2])  # the rule under the header: the table's whole width
    # whole; then "spent/budget" (two cells fewer); then a name ellipsized (refused: the full command's)
    for columns, taken in ((natural, True), (natural - 2, True), (natural - 3, False)):
        full = _same(home, "-n", "25", columns=columns)
        fast = _fast(home, monkeypatch, limit=25, columns=columns)
        assert fast == (full[1] if taken else None), columns
        assert ("spent/budget" in full[1]) == (columns < natural)
    full = _same(home, "-n", "7", columns=100)
    assert _fast(home, monkeypatch, limit=7, columns=100) == full[1]
    assert len(full[1].splitlines()) == 3 + 7 + 2


def test_a_watchdog_heartbeat_prints_the_same(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home, 3)
    dead = subprocess.Popen(["true"])
    dead.wait()
    hb = datetime.now(timezone.utc) - timedelta(hours=1)
    (home / "watchdog.json").write_text(json.dumps({"pid": dead.pid, "heartbeat_at": hb.isoformat(),
                                                    "started_at": hb.isoformat(), "interval_s": 5.0}))
    full = _same(home)
    assert _fast(home, monkeypatch) == full[1]
    assert f"pid {dead.pid} last seen" in full[1]


# ------------------------------------------------------------------------------ refused: the full command runs
def test_live_resources_go_to_the_full_command(tmp_path, monkeypatch):
    home = _home(tmp_path)
    led = _ledger(home)
    rid = _ended_run(led, 1)
    res = led.record_intent(rid, "vast", "instance", "n9", usd_per_hour=0.0)  # free: its figures do not move
    led.mark_created(res.id, "i-live", state="running")
    led.update_run(rid, deadline=None)  # no time left ticking between the two commands
    led.close()
    assert _fast(home, monkeypatch) is None
    full = _same(home, "--no-refresh")
    assert "live resources" in full[1] and "i-live" in full[1]


def test_a_damaged_row_goes_to_the_full_command_which_names_it(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home, 5)
    db = sqlite3.connect(home / "ledger.sqlite")
    db.execute("UPDATE runs SET status = 'exploded' WHERE id = 'run-0003'")
    db.commit()
    db.close()
    assert _fast(home, monkeypatch) is None
    full = _same(home)
    assert "damaged ledger row: run run-0003" in full[2] and "run-0003" not in full[1]


def test_a_resource_whose_attrs_the_records_refuse_goes_to_the_full_command(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home, 5)
    db = sqlite3.connect(home / "ledger.sqlite")
    db.execute("UPDATE resources SET attrs = '{\"python\": \"/tmp/evil\"}' WHERE run_id = 'run-0004'")
    db.commit()
    db.close()
    assert _fast(home, monkeypatch) is None
    full = _same(home)
    assert "damaged ledger row: run run-0004 resource" in full[2]


@pytest.mark.parametrize("column, value", [("budget_usd", "'five'"), ("created_at", "'2026-03-01T12:00:00'"),
                                           ("exit_codes", "'{\"0\": 1.0}'"), ("name", "x'41'"),
                                           ("recipe", "NULL"), ("exit_codes", "'{\"0\": true}'"),
                                           ("id", "'run-[b]1'")])
def test_a_row_the_records_might_coerce_goes_to_the_full_command(tmp_path, monkeypatch, column, value):
    """Values pydantic may coerce (or not): the fast path never decides, the full command does."""
    home = _home(tmp_path)
    _mixed(home, 3)
    db = sqlite3.connect(home / "ledger.sqlite")
    db.execute(f"UPDATE runs SET {column} = {value} WHERE id = 'run-0001'")
    db.commit()
    db.close()
    assert _fast(home, monkeypatch) is None


def test_a_pending_journal_goes_to_the_full_command(tmp_path, monkeypatch):
    from broker.money.journal import Journal

    home = _home(tmp_path)
    _mixed(home, 3)
    j = Journal(home)
    assert j.append({"op": "event", "run_id": "run-0001", "actor": "test", "action": "note", "message": "x"})
    assert _fast(home, monkeypatch) is None
    fast, full = _both(home)
    assert fast == full


def test_an_active_run_with_a_dead_cli_goes_to_the_full_command(tmp_path, monkeypatch):
    home = _home(tmp_path)
    led = _ledger(home)
    rid = _ended_run(led, 1, status="running", nodes=0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    led.update_run(rid, pid=dead.pid, ended_at=None)
    led.close()
    assert _fast(home, monkeypatch) is None
    full = _same(home, "--no-refresh")
    assert "interrupted" in full[1]


def test_what_the_fast_path_does_not_show_goes_to_the_full_command(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home, 3)
    assert _fast(home, monkeypatch) is not None
    # a terminal (colours), or rich told to act as one
    assert _fast(home, monkeypatch, tty=True) is None
    monkeypatch.setenv("FORCE_COLOR", "1")
    with pytest.raises(faststatus._NotMine):
        faststatus._render(20)
    monkeypatch.delenv("FORCE_COLOR")
    # a background run starting
    (home / "starting").mkdir(mode=0o700)
    (home / "starting" / "run-x.json").write_text("{}")
    assert _fast(home, monkeypatch) is None
    (home / "starting" / "run-x.json").unlink()
    assert _fast(home, monkeypatch) is not None
    # a ledger whose mode the full command narrows; a home it would create
    os.chmod(home / "ledger.sqlite", 0o644)
    assert _fast(home, monkeypatch) is None
    os.chmod(home / "ledger.sqlite", 0o600)
    assert _fast(tmp_path / "nowhere", monkeypatch) is None
    assert not (tmp_path / "nowhere").exists()
    # watchdog provider errors
    (home / "watchdog.json").write_text(json.dumps({"pid": 1, "heartbeat_at": _T0.isoformat(),
                                                    "errors": {"vast": "401 unauthorized"}}))
    assert _fast(home, monkeypatch) is None


def test_a_ledger_that_needs_migration_goes_to_the_full_command(tmp_path, monkeypatch):
    from tests.support.ledgers import schema_1_ledger

    home = _home(tmp_path)
    db = schema_1_ledger(home / "ledger.sqlite")
    db.commit()
    db.close()
    os.chmod(home / "ledger.sqlite", 0o600)
    assert _fast(home, monkeypatch) is None
    fast, full = _both(home)
    assert fast == full


def test_a_ledger_not_in_wal_mode_goes_to_the_full_command(tmp_path, monkeypatch):
    home = _home(tmp_path)
    _mixed(home, 2)
    assert _fast(home, monkeypatch) is not None
    db = sqlite3.connect(home / "ledger.sqlite")
    assert db.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    db.close()
    assert _fast(home, monkeypatch) is None


def test_a_newest_failed_run_with_a_diagnosis_goes_to_the_full_command(tmp_path, monkeypatch):
    from broker.cli import rundiag

    home = _home(tmp_path)
    _mixed(home, 3)
    monkeypatch.setattr(rundiag, "diagnosis_lines", lambda run: ["cause [oom]: out of memory"])
    db = sqlite3.connect(home / "ledger.sqlite")
    db.execute("UPDATE runs SET status = 'failed' WHERE id = 'run-0002'")
    db.commit()
    db.close()
    assert _fast(home, monkeypatch) is None


@pytest.mark.parametrize("args, limit", [
    (["status"], 20), (["status", "--no-refresh"], 20), (["status", "-r"], 20), (["status", "--refresh"], 20),
    (["status", "-n", "5"], 5), (["status", "--limit", "7", "--no-refresh"], 7),
    (["status", "--json"], None), (["status", "--wide"], None), (["status", "-w"], None),
    (["status", "run-1"], None), (["status", "latest"], None), (["status", "--help"], None),
    (["-v", "status"], None), (["status", "-n"], None), (["status", "-n", "0"], None),
    (["status", "-n", "-3"], None), (["status", "--limit=5"], None), (["status", "-n5"], None),
    (["status", "--refresh", "--no-refresh"], None), (["status", "--"], None), (["plan"], None), ([], None),
])
def test_parse_takes_only_the_common_forms(args, limit):
    assert faststatus.parse(args) == limit


def test_shell_completion_is_typers(monkeypatch):
    monkeypatch.setenv("_BROKER_COMPLETE", "complete_bash")
    assert faststatus.parse(["status"]) is None


def test_the_copies_of_the_ledgers_schema_facts_match_the_ledger():
    """faststatus reads the ledger without importing broker.money.ledger: its copies must follow the ledger's."""
    import re

    from broker.money import journal, ledger

    assert faststatus.SCHEMA_NAMES == set(re.findall(r"IF NOT EXISTS (\w+)", ledger._SCHEMA))
    assert faststatus.MIGRATED == tuple((t, c) for t, c, _ in ledger._MIGRATIONS)
    assert faststatus.SCHEMA_VERSION == ledger.SCHEMA_VERSION
    assert (faststatus.RUN_JSON, faststatus.RES_JSON, faststatus.TIMES) == (ledger._RUN_JSON, ledger._RES_JSON,
                                                                         ledger._TIMES)
    home = Path("/somewhere/home")
    beside, fallback = journal.Journal(home).paths()
    assert beside == home / faststatus.JOURNAL_NAME
    assert str(fallback.parent) == faststatus.JOURNAL_FALLBACK.format(euid=os.geteuid())
    assert fallback.name.endswith(".journal")


def test_a_journal_in_the_fallback_folder_goes_to_the_full_command(tmp_path, monkeypatch):
    from broker.money import journal

    home = _home(tmp_path)
    _mixed(home, 2)
    other = journal.fallback_path(tmp_path / "another-home")  # another home's journal there: still taken
    mine = journal.fallback_path(home)
    monkeypatch.setattr(faststatus, "JOURNAL_FALLBACK", str(tmp_path / "fallback"))
    (tmp_path / "fallback").mkdir()
    (tmp_path / "fallback" / other.name).write_text("")
    assert _fast(home, monkeypatch) is not None
    (tmp_path / "fallback" / mine.name).write_text("")
    assert _fast(home, monkeypatch) is None


@pytest.mark.parametrize("state", [dict(), dict(pid=4242, age_s=3700.0), dict(pid=4242, age_s=None),
                                   dict(pid=4242, alive=True, age_s=12.4), dict(pid=4242, alive=True, age_s=-0.6),
                                   dict(pid=4242, alive=True, age_s=9000.0)])
def test_the_watchdog_line_is_the_full_commands_in_a_pipe(state):
    """A live watchdog's age moves between two commands: the line is compared in-process, with the same state."""
    from rich.text import Text

    from broker.cli import status
    from broker.money.accounting import WatchdogState

    wd = WatchdogState(**state)
    assert faststatus._watchdog_line(wd) == Text.from_markup(status._watchdog_line(wd.to_dict(), set())).plain


def test_a_failure_inside_the_fast_path_leaves_the_line_to_the_full_command(tmp_path, monkeypatch):
    """Whatever the fast path cannot compute (a value the money code chokes on) is the full command's to report."""
    home = _home(tmp_path)
    _mixed(home, 2)
    monkeypatch.setenv("BROKER_HOME", str(home))
    monkeypatch.setattr(sys, "stdout", _Out())
    monkeypatch.setattr(faststatus, "_runs_table", lambda *a: 1 / 0)
    assert faststatus.run(20) is False
    assert sys.stdout.buffer.getvalue() == b""  # nothing printed before leaving it
