"""What only the ranks know, judged at the end of a run that exited 0: replicas that drifted apart (parameter
checksums per rank) and the samples the ranks' DistributedSamplers drew together.  Each case is a real 2-node
torchrun job on this machine (gloo) of one small one-bug program in tests/diagnose_logs/scripts/; a correct
book-style program gets no warning."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "diagnose_logs" / "scripts"

pytestmark = pytest.mark.slow


def _run(script: str, tmp_path: Path, args=()):
    pytest.importorskip("torch")
    from broker.run.launch import LocalLaunchSpec
    from tests.support.runs import run_local

    spec = LocalLaunchSpec(script_rel=script, args=list(args), workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=[], deadline_s=240, stall_s=30, on_stall="stop")
    res = run_local(spec, tmp_path / "run", echo=None)
    assert res.status == "succeeded", res.reason
    return res


def _line(script: str, text: str) -> int:
    return next(i + 1 for i, ln in enumerate((SCRIPTS / script).read_text().splitlines()) if text in ln)


def test_every_micro_step_in_no_sync_is_named_as_replicas_drifting_apart(tmp_path):
    res = _run("drift_no_sync.py", tmp_path)
    w = [x for x in res.warnings if x.startswith("the replicas drifted apart")]
    assert w and "DDP-wrapped parameters differ between the ranks" in w[0], res.warnings
    assert "every forward ran inside no_sync()" in w[0], w


def test_weights_never_broadcast_in_a_hand_written_loop_are_named(tmp_path):
    res = _run("drift_no_broadcast.py", tmp_path)
    w = [x for x in res.warnings if x.startswith("the replicas drifted apart")]
    assert w and "parameters the optimizers update" in w[0] and "never broadcast" in w[0], res.warnings


def test_num_replicas_for_another_world_size_is_named_with_the_samples_drawn(tmp_path):
    res = _run("sampler_replicas.py", tmp_path)
    at = _line("sampler_replicas.py", "DistributedSampler(ds, num_replicas=4")
    assert (f"together the ranks drew 32 of 64 samples per epoch because num_replicas=4 in a 2-rank job "
            f"(sampler_replicas.py:{at})") in "\n".join(res.warnings), res.warnings


def test_set_epoch_on_the_wrong_sampler_is_named(tmp_path):
    res = _run("sampler_wrong_epoch.py", tmp_path)
    built = _line("sampler_wrong_epoch.py", "train_sampler = DistributedSampler")
    called = _line("sampler_wrong_epoch.py", "val_sampler.set_epoch(epoch)")
    assert (f"set_epoch is never called on the sampler that feeds training (sampler_wrong_epoch.py:{built}, 2 "
            f"epochs: the same order every epoch); sampler_wrong_epoch.py:{called} calls it on another one") \
        in "\n".join(res.warnings), res.warnings


def test_a_correct_book_style_script_gets_no_warning(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    res = _run("ok_book.py", tmp_path, [str(out)])
    assert res.warnings == [] and (out / "model.pt").exists(), res.warnings


def test_rank_0_evaluating_through_the_ddp_model_is_the_cause_not_the_rank_that_exited_0(tmp_path):
    """Rank 0's extra DDP forward (a buffer broadcast) pairs with rank 1's training collectives; rank 1 finishes
    and exits 0, rank 0 then loses its peer.  It was "rank 1 exited 0 before a collective ...: it is the cause";
    the ranks' sequences name rank 0, its line and the rank test around it, and rank 1 is not blamed."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from broker.run.launch import LocalLaunchSpec
    from tests.support.runs import run_local

    spec = LocalLaunchSpec(script_rel="eval_rank0_ddp.py", args=[], workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=[], deadline_s=240, stall_s=60, on_stall="stop")
    res = run_local(spec, tmp_path / "run", echo=None)
    assert res.status == "failed", res.reason
    ev = _line("eval_rank0_ddp.py", 'print("eval", model(')
    text = "\n".join(explain(tmp_path / "run", res, 2, local=True).lines())
    assert text.startswith(f"rank(s) 0 left the ranks' common path at collective #5: DDP forward (buffer broadcast) "
                           f"at eval_rank0_ddp.py:{ev}, under `if rank == 0:` (line {ev - 2}),"), text
    assert "evaluate through model.module" in text and "it is the cause" not in text, text


def test_a_native_abort_without_a_python_frame_gets_the_last_user_line_from_the_collective_record(tmp_path):
    """Rank 1 dies by SIGABRT in native code: no traceback, no exception in its facts.  The summary still gives a
    user line: the calling line of the last collective the shim recorded for that rank."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from broker.run.launch import LocalLaunchSpec
    from tests.support.runs import run_local

    spec = LocalLaunchSpec(script_rel="cpp_abort.py", args=[], workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=[], deadline_s=240, stall_s=60, on_stall="stop")
    res = run_local(spec, tmp_path / "run", echo=None)
    assert res.status == "failed", res.reason
    at = _line("cpp_abort.py", "    dist.all_reduce(t)")
    text = "\n".join(explain(tmp_path / "run", res, 2).lines())
    assert "rank 1 failed first: exit code -6 (SIGABRT)" in text, text
    assert f"  at cpp_abort.py:{at} in all_reduce: (no Python frame: the last collective its record holds)" in text


def test_a_rank_that_skipped_backward_is_named_with_its_line_not_the_rank_that_lost_its_peer(tmp_path):
    """Rank 1 skips backward() for its one outlier batch: it makes one gradient all-reduce fewer, the ranks'
    all-reduces pair off by one, rank 1 ends first and rank 0 loses its peer in its last all-reduce.  It was "rank
    1 exited 0 before a collective ...: it is the cause" (no line, no cause); the shim notes a synced forward
    followed by another with no backward() between, and the summary names rank 1, the collective where the ranks'
    sequences part, the forward's line and the skipped backward(), and does not blame rank 0's failure."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from broker.run.launch import LocalLaunchSpec
    from tests.support.runs import run_local

    spec = LocalLaunchSpec(script_rel="skip_backward.py", args=[], workdir=SCRIPTS, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=[], deadline_s=240, stall_s=60, on_stall="stop")
    res = run_local(spec, tmp_path / "run", echo=None)
    assert res.status == "failed", res.reason
    fwd = _line("skip_backward.py", "loss = model(x)")
    bwd = _line("skip_backward.py", "    loss.backward()")
    text = "\n".join(explain(tmp_path / "run", res, 2, local=True).lines())
    assert text.startswith(f"rank(s) 1 left the ranks' common path at collective #3: skipped backward() after its "
                           f"forward #3 of the DDP model (the next forward, at skip_backward.py:{fwd}, came with no "
                           f"backward() between them), where rank 0 made backward (DDP gradient all-reduce) at "
                           f"skip_backward.py:{bwd}; from there the ranks' gradient all-reduces pair off by one "
                           "(rank 0: 6 synchronised backward() calls, rank 1: 5 synchronised backward() calls)"), text
    assert "call backward() on every rank for every forward" in text, text
    assert "it is the cause" not in text and not text.startswith("node 0"), text


def test_skipped_backward_calls_that_end_in_drifted_replicas_are_named_as_the_cause(tmp_path):
    """Each rank skips backward() for its own outlier batch (batch 2 on rank 0, 4 on rank 1) but still steps (SGD
    with momentum): as many all-reduces on each rank, so the run succeeds, with replicas apart.  The drift's cause
    was "the ranks' updates differed (a rank skipped a step, or ...)"; it is now the skipped backward(), the rank,
    the forwards and the line."""
    res = _run("skip_backward_drift.py", tmp_path)
    fwd = _line("skip_backward_drift.py", "loss = model(x)")
    w = [x for x in res.warnings if x.startswith("the replicas drifted apart")]
    assert w and (f"likely cause: rank(s) 0 left the ranks' common path at collective #3: skipped backward() after "
                  f"its forward #3 of the DDP model (the next forward, at skip_backward_drift.py:{fwd}, came with no "
                  "backward() between them)") in w[0], res.warnings
    assert "every rank skipped as often, after different forwards (rank 0: #3, rank 1: #5)" in w[0], w
