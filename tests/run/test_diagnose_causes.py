"""The causes the first catalogue got wrong or missed, each on a log captured by running the fault for real
(scripts/capture_diagnose_logs.py CASE: two torchrun nodes on CPU/gloo through broker's local launcher and the
rank shim; tcp_localhost and master_env on two netns hosts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.run.diagnose import Diagnosis, explain, searchable_lines

CPU = Path(__file__).resolve().parents[1] / "diagnose_logs" / "cpu"


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
    ("ddp_models", "ddp-different-models", "appears not to match sizes of the same param in process 0"),
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
    assert body == msg[1:1 + len(body)] and len(body) >= min(1, len(msg) - 1)  # torch's lines, in order, none cut by the frame
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
    assert "failed first" not in t and "exit code 1" not in t, t
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


# ------------------------------------------------------------------------------------------------ silent wrong results
def _succeeded(case: str):
    from broker.run.supervisor import RunResult, finish_result

    d = CPU / case
    logs = {int(p.stem[4:]): p for p in d.glob("node*.log")}
    return d, finish_result(RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=1.0, log_paths=logs), [],
                            nnodes=2, nproc_per_node=1)


def test_no_sampler_and_one_checkpoint_path_end_succeeded_with_2_warnings(capsys):
    """Every rank iterated all 16 samples (no DistributedSampler) and saved checkpoint.pt: exit 0 everywhere, and
    the run is "succeeded, with 2 warnings" naming both causes, in the summary too."""
    from broker.cli import summary
    from broker.run.pipeline import diagnose as diagnose_step

    d, res = _succeeded("silent_wrong")
    assert res.ok and res.shown_status == "succeeded, with 2 warnings", res.warnings
    assert "every rank saw all 16 samples of its DataLoader (no DistributedSampler)" in res.warnings[0]
    assert res.warnings[1].startswith("ranks 0, 1 all wrote checkpoint.pt with torch.save")
    res = diagnose_step(res, SimpleNamespace(nodes=2), d)
    assert [ln for ln in res.diagnosis if ln.startswith("warning: ")] == [f"warning: {w}" for w in res.warnings]
    (d / "diagnosis.txt").unlink()
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(d))
    summary.render_summary(run, res, SimpleNamespace(nodes=2))
    out = " ".join(capsys.readouterr().out.split())
    assert "status: succeeded, with 2 warnings" in out and "no DistributedSampler" in out, out


def test_distributed_sampler_without_set_epoch_is_a_warning():
    from broker.cli.run import result_dict

    _, res = _succeeded("no_set_epoch")
    assert res.shown_status == "succeeded, with 1 warning", res.warnings
    assert result_dict(res)["warnings"] == res.warnings and result_dict(res)["status"] == "succeeded"
    assert res.warnings[0].startswith("DistributedSampler.set_epoch was never called on rank(s) 0, 1 over 2 epochs")


def test_a_correct_run_has_no_warnings():
    _, res = _succeeded("ok")
    assert res.warnings == [] and res.shown_status == "succeeded"


def test_gloo_timeout_names_the_rank_that_never_arrived_from_the_collective_counts():
    """On gloo there is no NCCL 'last enqueued work' line: the shim's count of each rank's collective calls
    (rank 0 in its second all_reduce, rank 1 asleep after its first) names rank 1."""
    d = diagnose("gloo_timeout")
    assert d.behind == [1]
    assert "never arrived at the collective the others waited in: rank(s) 1" in text(d)


# ------------------------------------------------------------------------------------------------ the catalogue's notes
def _lint_kinds() -> set[str]:
    from broker.lint import ddp, kinds, shell

    return set(kinds.KINDS) | set(ddp.KINDS) | set(ddp.CPU_FIXES) | set(shell.FIXES)


def _preflight_checks() -> set[str]:
    import re as _re

    import broker.run.preflight as pf

    return set(_re.findall(r'Check\("([a-z][a-z ]*)"', Path(pf.__file__).read_text()))


def test_every_caught_by_note_names_a_rule_or_check_that_exists():
    """The "would have been caught by" notes are not stale: every lint rule and preflight check they name is
    one broker has, and no entry says "no lint rule yet"."""
    import re as _re

    from broker.run.diagnose import catalogue

    kinds, checks = _lint_kinds(), _preflight_checks()
    assert {"hard-coded-world-size", "cuda-without-check", "sbatch-python-not-srun"} <= kinds
    assert {"torch", "tcp listen", "interface", "disk", "cuda"} <= checks
    named = 0
    for e in catalogue():
        note = e.caught_by
        assert "yet" not in note, (e.id, note)
        for m in _re.finditer(r"lint rules? ([\w-]+(?:(?:, | and )[\w-]+)*)", note):
            for rule in _re.split(r", | and ", m.group(1)):
                assert rule in kinds, f"{e.id}: caught_by names lint rule {rule!r}, which broker lint does not have"
                named += 1
        for m in _re.finditer(r"preflight check ([a-z]+(?: listen)?)", note):
            assert m.group(1) in checks, f"{e.id}: caught_by names preflight check {m.group(1)!r}, which is not one"
            named += 1
    assert named >= 12


@pytest.mark.parametrize("entry, rule", [
    ("world-size-mismatch", "hard-coded-world-size"), ("init-method-localhost", "init-method-localhost"),
    ("master-env-overwritten", "master-env-in-script"), ("cuda-on-cpu-run", "cuda-without-check"),
    ("duplicate-rank", "slurm-env-under-torchrun"), ("invalid-device-ordinal", "device-from-rank"),
    ("collective-timeout", "collective-under-rank0"),
])
def test_a_cause_a_lint_rule_finds_says_which(entry, rule):
    from broker.run.diagnose import catalogue

    (e,) = [x for x in catalogue() if x.id == entry]
    assert rule in e.caught_by and not e.caught_by.startswith("none"), e.caught_by


@pytest.mark.parametrize("status", ["interrupted", "deadline"])
def test_a_rank_whose_peer_broker_stopped_is_not_blamed(status):
    """After `broker down RUN` of a background run, `status RUN` opened with "node 1, rank 1 failed first:
    RuntimeError ... Connection reset by peer": the reset is what stopping node 0 did to node 1's collective."""
    from broker.run.diagnose import Diagnosis, _stopped_run

    reset = {"type": "RuntimeError", "message": "[../gloo/transport/tcp/pair.cc:534] Read error "
             "[198.18.3.10]:29500: Connection reset by peer", "frame": None}
    facts = [{"node": 0, "rank": 0, "ended": 10.0, "exception": {"type": "KeyboardInterrupt", "message": ""}},
             {"node": 1, "rank": 1, "ended": 10.2, "exception": reset}]
    d = _stopped_run(Diagnosis(), status, facts)
    assert d.first is None and "broker stopped every node" in " ".join(d.notes)
    own = dict(facts[1], exception={"type": "ValueError", "message": "bad shape", "frame": None}, ended=5.0)
    assert _stopped_run(Diagnosis(), status, [facts[0], own]).first.rank == 1  # its own error, before the stop
