"""The causes the first catalogue got wrong or missed, each on a log captured by running the fault for real
(scripts/capture_diagnose_logs.py CASE: two torchrun nodes on CPU/gloo through broker's local launcher and the
rank shim; tcp_localhost and master_env on two netns hosts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.diagnose import Diagnosis, explain, searchable_lines

CPU = Path(__file__).resolve().parent / "diagnose_logs" / "cpu"


def diagnose(name: str) -> Diagnosis:
    d = CPU / name
    r = json.loads((d / "result.json").read_text())
    res = SimpleNamespace(status=r["status"], exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                          log_paths={int(p.stem[4:]): p for p in d.glob("node*.log")})
    return explain(d, res, 2)


def ids(d: Diagnosis) -> list[str]:
    return [f.entry.id for f in d.findings]


def text(d: Diagnosis) -> str:
    return "\n".join(d.lines())


def test_hard_coded_world_size_is_named_not_a_rank_that_never_arrived():
    d = diagnose("world_size4")
    assert ids(d)[0] == "world-size-mismatch", ids(d)
    assert "collective-timeout" not in ids(d)
    assert "world_size=4 but torchrun started 2 rank(s)" in d.findings[0].cause


def test_different_shapes_in_all_reduce_are_named_not_peer_gone():
    d = diagnose("shapes")
    assert ids(d)[0] == "collective-shapes-differ", ids(d)
    assert "peer-gone" not in ids(d) and "collective-timeout" not in ids(d)
    assert "all_reduce call #1: rank 0 (1,) float32, rank 1 (2,) float32" in d.findings[0].cause


def test_a_slow_rank_is_slow_not_missing():
    d = diagnose("slow_rank")
    assert ids(d)[0] == "slow-rank", ids(d)
    assert "rank 1 reached all_reduce call #" in d.findings[0].cause
    assert "lower init_process_group(timeout" not in text(d) and "raise init_process_group(timeout" in text(d)


def test_cuda_set_device_on_a_cpu_run():
    d = diagnose("cuda_on_cpu")
    assert ids(d)[0] == "cuda-on-cpu-run", ids(d)
    t = text(d)
    assert "_cuda_setDevice" in t and "this run is CPU-only (gloo)" in t and "torch.cuda.is_available()" in t


@pytest.mark.parametrize("case, entry, torch_text", [
    ("ddp_unused", "ddp-unused-parameters", "Expected to have finished reduction in the prior iteration"),
    ("ddp_models", "ddp-different-models", "DDP expects same model across all ranks"),
])
def test_ddp_errors_keep_torchs_text_whole_then_the_cause(case, entry, torch_text):
    d = diagnose(case)
    assert ids(d)[0] == entry, ids(d)
    lines = d.lines()
    first = d.first
    msg = [ln.strip() for ln in first.message.strip().splitlines() if ln.strip()]
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  at "))
    cause = next(i for i, ln in enumerate(lines) if ln.startswith("cause ["))
    body = [ln.strip() for ln in lines[1:at]]
    assert torch_text in lines[0]
    assert body == msg[1:1 + len(body)] and len(body) >= 1  # torch's lines, in order, none cut by the frame
    assert at < cause


def test_a_comment_quoting_an_error_is_not_the_diagnosis():
    d = diagnose("comment_text")
    assert "invalid-device-ordinal" not in ids(d), ids(d)
    assert d.first.exc_type == "KeyError"
    log = (CPU / "comment_text" / "node0.log").read_text()
    assert "invalid device ordinal" in log  # the traceback does print the comment
    assert not any("invalid device ordinal" in ln for ln in searchable_lines(log))


def test_a_node_without_torch_says_so():
    d = diagnose("no_torch")
    assert ids(d)[0] == "torch-missing", ids(d)
    assert "No module named 'torch'" in d.headline and "exit code 1" not in d.headline
    assert "cannot import torch" in text(d)


@pytest.mark.parametrize("case, why", [("deadline", "the deadline passed"), ("interrupted", "interrupted")])
def test_deadline_and_interrupted_runs_blame_no_node_broker_stopped(case, why):
    d = diagnose(case)
    t = text(d)
    assert "failed first" not in t and "exit code" not in t, t
    assert why in t and "broker stopped every node" in t


@pytest.mark.parametrize("case, entry, what", [
    ("tcp_localhost", "init-method-localhost", "'tcp://localhost:29511'"),
    ("master_env", "master-env-overwritten", "localhost:12355 where torchrun gave"),
])
def test_rendezvous_written_into_the_script(case, entry, what):
    d = diagnose(case)
    assert ids(d)[0] == entry, (ids(d), d.lines())
    assert what in d.findings[0].cause


def test_symptoms_stay_when_no_fact_explains_them(tmp_path):
    """Without the facts' cause (the shapes case with its last-collective facts removed) the old symptom entries
    are still given: a cause is dropped only when a better one is there."""
    shutil.copytree(CPU / "shapes", tmp_path / "run")
    for f in (tmp_path / "run").glob("node*/facts/rank*.json"):
        d = json.loads(f.read_text())
        d.pop("last_collective", None)
        f.write_text(json.dumps(d))
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    res = SimpleNamespace(status=r["status"], exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                          log_paths={int(p.stem[4:]): p for p in (tmp_path / "run").glob("node*.log")})
    got = ids(explain(tmp_path / "run", res, 2))
    assert "collective-shapes-differ" not in got and ("collective-timeout" in got or "peer-gone" in got)
