"""`broker offers` at 80 columns wraps a place between words, never inside one ("us-central" / "1",
"Washington" / ", US, NA")."""

from __future__ import annotations

import subprocess
import sys


def test_offers_at_80_columns_never_cut_a_region_or_place_name(cli_env):
    env = dict(cli_env, COLUMNS="80", BROKER_NO_WRAP="0")
    cp = subprocess.run([sys.executable, "-m", "broker", "offers"], env=env, capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    head = next(ln for ln in lines if " where " in ln and " net" in ln)
    a, b = head.index("where"), head.index(" net")
    rows = [ln for ln in lines[lines.index(head) + 2:] if ln.startswith(" ")]
    where = [ln[a:b].strip() for ln in rows]  # the "where" column's cells, line by line
    assert any("us-central1" in ln for ln in rows), cp.stdout
    for cell in where:
        assert not cell.startswith((",", "1 ")) and cell != "1", cp.stdout  # the rest of a cut word
    from rich.cells import cell_len

    assert max(cell_len(ln) for ln in lines) <= 80, cp.stdout  # and no row one column too wide (81 was seen)
