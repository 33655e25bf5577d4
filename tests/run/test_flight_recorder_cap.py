"""The NCCL flight-recorder reader caps while it reads: a node's dump file larger than the cap is refused with a
line after reading at most cap + 1 bytes (a 4 GiB file read under a 1 GiB address-space limit), never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
from broker.run.stall import flight_recorder_from_run
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
print("\n".join(flight_recorder_from_run(sys.argv[2])))
"""


def test_a_huge_dump_is_refused_with_a_line_without_loading_it(tmp_path):
    facts = tmp_path / "node0" / "facts"
    facts.mkdir(parents=True)
    with open(facts / "fr_trace_rank0", "wb") as f:  # sparse: costs no disk
        f.truncate(4 << 30)
    (tmp_path / "node1" / "facts").mkdir(parents=True)
    (tmp_path / "node1" / "facts" / "fr_trace_rank1").write_text(json.dumps(
        {"version": "2.10", "entries": [{"collective_seq_id": 3, "profiling_name": "nccl:all_reduce",
                                         "input_sizes": [[4]], "state": "completed"}]}))
    cp = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(tmp_path)], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stderr[-2000:]
    lines = cp.stdout.splitlines()
    assert any("fr_trace_rank0" in ln and "is larger than 64 MiB: not read" in ln for ln in lines), lines
    assert "flight recorder: rank 1's last collective is #3 all_reduce [[4]] (completed)" in lines


def test_a_fifo_in_place_of_a_dump_is_skipped_without_blocking(tmp_path):
    from broker.run.stall import read_flight_recorder

    os.mkfifo(tmp_path / "fr_trace_rank0")
    assert read_flight_recorder(tmp_path / "fr_trace_rank0") is None
    notes: list[str] = []
    big = tmp_path / "fr_trace_rank1"
    big.write_bytes(b"{" + b" " * 2000)
    assert read_flight_recorder(big, max_bytes=1000, notes=notes) is None and "larger than" in notes[0]
