"""Stall detection (broker/run/stall.py): a real 2-node torchrun job that hangs (rank 0 in all_reduce, rank 1 in
time.sleep) is named with both ranks' places long before its deadline; the stack parsers and the verdicts on
faulthandler / py-spy text; the flight-recorder reader on real dumps."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.run.stall import (Frame, StallWatch, flight_recorder_from_run, parse_stacks, place_of, places_from_sample,
                          read_flight_recorder, stack_answers, verdict)

REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / "tests" / "diagnose_logs"
FAULT = LOGS / "scripts" / "fault.py"


def _line(code: str) -> int:
    """The line of ``code`` in fault.py's hang mode (the test does not hard-code line numbers)."""
    lines = FAULT.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if 'mode == "hang"' in ln)
    return next(i + 1 for i in range(start, len(lines)) if lines[i].strip() == code)


def _hang_spec(stall_s: float, on_stall: str, deadline_s: float, mode: str = "hang"):
    from broker.run.launch import LocalLaunchSpec

    return LocalLaunchSpec(script_rel="fault.py", args=[mode], workdir=FAULT.parent, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "FAULT_TIMEOUT_S": "600", "CUDA_VISIBLE_DEVICES": ""},
                           node_envs=[{}, {}], setup=[], expect=[], deadline_s=deadline_s, stall_s=stall_s,
                           on_stall=on_stall)


def test_a_real_hang_is_named_with_both_ranks_places_and_stopped(tmp_path):
    """The exact case: rank 0 waits in all_reduce, rank 1 sleeps.  stall_s 5 and a 90 s deadline: the run ends as
    a stall (not at the deadline) with both places; the console gets one line for the nodes broker stopped."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from tests.support.runs import run_local

    lines: list[str] = []
    res = run_local(_hang_spec(5, "stop", 90), tmp_path / "run", echo=lines.append)
    sleep_at, reduce_at = _line("time.sleep(600)"), _line("dist.all_reduce(t)")
    want = (f"rank 0 waits in all_reduce at fault.py:{reduce_at}; rank 1 never called all_reduce: it is in "
            f"time.sleep at fault.py:{sleep_at}")
    assert res.status == "failed" and res.reason.startswith("stalled: no output for "), res.reason
    assert want in res.reason, res.reason
    assert any(want in ln for ln in lines), lines
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    assert st["stopped"] and [r["collective"] for r in st["ranks"]] == ["all_reduce", None]
    assert "rank(s) 1 never reached the all_reduce" in st["cause"]
    assert "=== rank 0" in (tmp_path / "run" / "stacks.txt").read_text()
    text = "\n".join(explain(tmp_path / "run", res, 2).lines())
    assert text.startswith(f"stalled: {want}") and "failed first" not in text, text
    assert "fix: every rank must call the same collectives in the same order" in text
    # broker's SIGTERM makes torchrun print a SignalException traceback: in the node log, not on the console
    console = "\n".join(lines)
    assert "SignalException" not in console and "stopping node(s) 0, 1" in console
    assert "SignalException" in (tmp_path / "run" / "node0.log").read_text()


def test_on_stall_report_keeps_the_run_going_to_its_deadline(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from tests.support.runs import DeadlineNow, run_local

    # the deadline comes 3 s after the report (the run went on past it), however long start-up took on a loaded
    # host; the spec's own 120 s is only the backstop
    deadline = DeadlineNow(monkeypatch)
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if "on_stall: report -> the run goes on" in line:
            deadline.after(3)

    res = run_local(_hang_spec(4, "report", 120), tmp_path / "run", echo=echo)
    assert res.status == "deadline" and deadline.fired_at is not None, (res.reason, lines[-20:])
    assert any("on_stall: report -> the run goes on" in ln for ln in lines), lines
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    assert not st["stopped"] and st["ranks"][1]["code"] == "time.sleep(600)"
    d = explain(tmp_path / "run", res, 2)
    text = "\n".join(d.lines())
    assert "rank 1 never called all_reduce" in text and "failed first" not in text, text
    assert "the deadline passed: broker stopped every node" in text


def test_rank0_only_evaluation_through_the_ddp_model_is_named(tmp_path):
    """Rank 0 evaluates through the DDP model (its forward broadcasts BatchNorm's buffers), rank 1 does not: the
    stall names DDP's forward on rank 0, not a bare 'all ranks timed out'."""
    pytest.importorskip("torch")
    from tests.support.runs import run_local

    res = run_local(_hang_spec(5, "stop", 120, "eval_rank0"), tmp_path / "run", echo=None)
    assert res.status == "failed", res.reason
    assert "rank 0 waits in the DDP model's forward (it broadcasts buffers such as BatchNorm's from rank 0)" \
        in res.reason and "rank 1 never called the DDP model's forward: it is in time.sleep" in res.reason


def test_uneven_batches_per_rank_hang_at_the_last_step_is_named(tmp_path):
    """Rank 0 has 3 batches, rank 1 has 2 (no DistributedSampler): rank 1 leaves the loop and waits in the
    barrier after it while rank 0's third backward() waits for a gradient all-reduce no one joins.  Named as uneven
    data per rank, with both places and DDP's join() / a DistributedSampler as the fix."""
    pytest.importorskip("torch")
    from tests.support.runs import run_local

    res = run_local(_hang_spec(5, "stop", 120, "uneven"), tmp_path / "run", echo=None)
    step = _line_in("uneven", "model(x).sum().backward()  # DDP all-reduces the gradients here: rank 0's third "
                              "one has no partner")
    after = _line_in("uneven", 'dist.barrier()  # "wait for everyone before saving"')
    assert res.status == "failed", res.reason
    assert (f"rank 0 waits in backward() (under DDP it all-reduces the gradients) at fault.py:{step}; "
            f"rank 1 waits in barrier at fault.py:{after}") in res.reason, res.reason
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    assert st["cause"].startswith(f"rank(s) 1 left the training loop (waiting in barrier at fault.py:{after}) "
                                  f"while rank(s) 0 still run a step"), st["cause"]
    assert "different numbers of batches" in st["cause"] and "model.join()" in st["fix"]


def _line_in(mode: str, code: str) -> int:
    lines = FAULT.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if f'mode == "{mode}"' in ln)
    return next(i + 1 for i in range(start, len(lines)) if lines[i].strip() == code)


def test_a_rank_that_computes_silently_is_slow_not_stalled(tmp_path):
    """Rank 1 spins on one line for 20 s (the same stack in every sample) while rank 0 waits in all_reduce:
    it uses CPU, so it is computing; the run is not stopped and ends by itself, with one report line."""
    pytest.importorskip("torch")
    from tests.support.runs import run_local

    lines: list[str] = []
    res = run_local(_hang_spec(4, "stop", 120, "busy"), tmp_path / "run", echo=lines.append)
    assert res.status == "succeeded", (res.reason, lines[-20:])
    assert any("rank 1 is busy" in ln and "(computing, not stuck: not stopped)" in ln for ln in lines), lines
    assert not (tmp_path / "run" / "stall.json").exists()


# ------------------------------------------------------------------------------------------------ stacks
FAULTHANDLER = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 629 in wait
  File "/v/lib/python3.11/site-packages/torch/utils/data/_utils/pin_memory.py", line 50 in _pin_memory_loop

Current thread 0x00007f0000000001 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3000 in all_gather_object
  File "/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "train.py", line 40 in evaluate
  File "train.py", line 52 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 287 in run_path
  File "/n/rankshim.py", line 400 in main
  File "/n/rankshim.py", line 420 in <module>
"""

#: py-spy dump's layout (py-spy 0.3/0.4: "Thread TID (state): \"name\"", then "    func (file:line)")
PYSPY = """\
Process 4242: /v/bin/python -u /n/rankshim.py --facts /n/facts -- train.py
Python v3.11.9 (/v/bin/python3.11)

Thread 4242 (idle): "MainThread"
    backward (torch/_tensor.py:626)
    _engine_run_backward (torch/autograd/graph.py:823)
    backward (torch/autograd/__init__.py:347)
    step (/n/work/train.py:31)
    <module> (/n/work/train.py:60)
    _run_code (<frozen runpy>:88)
    main (/n/rankshim.py:400)
Thread 4300 (idle): "Thread-1"
    wait (threading.py:331)
"""


def test_faulthandler_dump_names_the_outermost_collective_under_the_users_line():
    pl = place_of(0, 0, FAULTHANDLER, {"train.py:40": "gathered = gather(preds)"})
    assert pl.collective == "all_gather_object" and pl.user == Frame("train.py", 40, "evaluate")
    assert pl.describe() == "rank 0 waits in all_gather_object at train.py:40"


def test_pyspy_dump_is_read_too():
    threads = parse_stacks(PYSPY)
    assert [len(f) for _, f in threads] == [7, 1]
    pl = place_of(1, 1, PYSPY, {"/n/work/train.py:31": "loss.backward()"})
    assert pl.collective.startswith("backward()") and pl.user.short == "train.py:31"


def test_only_the_last_dump_of_a_grown_stack_file_counts():
    older = FAULTHANDLER.replace("line 40 in evaluate", "line 99 in evaluate")
    assert place_of(0, 0, older + FAULTHANDLER).user.line == 40


def _entry(rank, collective=None, line=33, code="time.sleep(600)", ended=False, **kw):
    if ended:
        return {"node": rank, "ended": True, **kw}
    frames = ['Current thread 0x1 (most recent call first):']
    if collective:
        frames.append(f'  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 1 in {collective}')
    frames.append(f'  File "train.py", line {line} in <module>')
    return {"node": rank, "tool": "faulthandler", "text": "\n".join(frames) + "\n",
            "code": {f"train.py:{line}": code}}


@pytest.mark.parametrize("sample, head, cause", [
    ({"0": _entry(0, "all_reduce", 40, "dist.all_reduce(t)"), "1": _entry(1)},
     "rank 0 waits in all_reduce at train.py:40; rank 1 never called all_reduce: it is in time.sleep at train.py:33",
     "rank(s) 1 never reached the all_reduce"),
    ({"0": _entry(0, "all_reduce", 40), "1": _entry(1, "barrier", 45)},
     "rank 0 waits in all_reduce at train.py:40; rank 1 waits in barrier at train.py:45", "a different order"),
    ({"0": _entry(0, "all_reduce", 40), "1": _entry(1, "all_reduce", 40)},
     "rank 0 waits in all_reduce at train.py:40; rank 1 waits in all_reduce at train.py:40", "tensors differ"),
    ({"0": _entry(0, "all_reduce", 40), "1": _entry(1, ended=True, exit_code=0)},
     "rank 0 waits in all_reduce at train.py:40; rank 1 has already ended (exited with code 0)", "ended while"),
    ({"0": _entry(0, None, 20, "x = heavy(batch)"), "1": _entry(1, None, 20, "x = heavy(batch)")},
     "rank 0 is in heavy at train.py:20; rank 1 is in heavy at train.py:20", "no rank is inside a collective"),
    ({"0": {**_entry(0, None, 30, "loss.backward()"), "text": "Current thread 0x1 (most recent call first):\n"
            '  File "/v/site-packages/torch/autograd/__init__.py", line 1 in backward\n'
            '  File "train.py", line 30 in <module>\n'}, "1": _entry(1, "barrier", 35, "dist.barrier()")},
     "rank 0 waits in backward() (under DDP it all-reduces the gradients) at train.py:30; rank 1 waits in barrier "
     "at train.py:35", "rank(s) 1 left the training loop"),
    ({"0": _entry(0, "init_process_group", 9), "1": _entry(1, "init_process_group", 9)},
     "rank 0 waits in init_process_group at train.py:9", "world_size or rank given to init_process_group"),
])
def test_verdicts(sample, head, cause):
    v = verdict(places_from_sample(sample), 2)
    assert v.headline.startswith(head) and cause in v.cause, (v.headline, v.cause)


def test_a_rank_without_a_stack_is_named():
    v = verdict(places_from_sample({"0": _entry(0, "all_reduce", 40)}), 2)
    assert v.lines[-1] == "no stack from rank(s) 1 (not started, or gone)"


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_watch_needs_silence_and_two_equal_samples(monkeypatch):
    import broker.run.stall as stall

    clock = _Clock()
    samples = [{"0": _entry(0, "all_reduce", 40), "1": _entry(1, None, 33)},
               {"0": _entry(0, "all_reduce", 40), "1": _entry(1, None, 34)},  # rank 1 moved: progress
               {"0": _entry(0, "all_reduce", 40), "1": _entry(1, None, 34)},
               {"0": _entry(0, "all_reduce", 40), "1": _entry(1, None, 34)}]
    monkeypatch.setattr(stall.time, "sleep", lambda s: setattr(clock, "t", clock.t + s))
    said: list[str] = []
    w = StallWatch(10, lambda: samples.pop(0), clock=clock, echo=said.append, gap_s=3)
    clock.t = 9.9
    assert not w.check() and len(samples) == 4  # not silent long enough: no sample
    clock.t = 10.0
    assert not w.check() and len(samples) == 2  # the stacks moved between the samples: not a stall, re-armed
    clock.t += 10
    assert w.check() and not samples and "rank 1 never called all_reduce" in w.reason
    assert any(s.startswith("[broker] stalled: no output for") for s in said)


def test_a_rank_still_importing_is_starting_not_stalled():
    importing = {"node": 1, "text": "Current thread 0x1 (most recent call first):\n"
                 '  File "<frozen importlib._bootstrap>", line 1 in _find_and_load\n'
                 '  File "train.py", line 2 in <module>\n', "code": {"train.py:2": "import torch"}}
    clock = _Clock()
    w = StallWatch(5, lambda: {"0": _entry(0, "init_process_group", 9), "1": importing}, clock=clock, gap_s=0)
    clock.t = 6
    assert not w.check() and w.found is None


def test_cpu_use_between_the_samples_tells_computing_from_blocked():
    def sample(cpu1, t):
        e0, e1 = _entry(0, "all_reduce", 40), _entry(1, None, 33, "x = step(batch)")
        e0.update(cpu_s=1.0, t=t)
        e1.update(cpu_s=cpu1, t=t)
        return {"0": e0, "1": e1}

    # 2.5 of 3 s on a core: busy; 0.01 (what a rank blocked in a collective used here, the stack dump): blocked
    for cpu_late, stalled in ((5.0 + 2.5, False), (5.0 + 0.01, True)):
        samples = [sample(5.0, 100.0), sample(cpu_late, 103.0)]
        clock = _Clock()
        w = StallWatch(5, lambda: samples.pop(0), clock=clock, gap_s=0)
        clock.t = 6
        assert w.check() is stalled


def test_watch_does_not_judge_when_no_rank_answers():
    clock = _Clock()
    w = StallWatch(5, lambda: {}, clock=clock, gap_s=0)
    clock.t = 6
    assert not w.check() and w.found is None


# ------------------------------------------------------------------------------------------------ flight recorder
def test_flight_recorder_dumps_name_the_rank_behind():
    """Real dumps (torch 2.13 gloo, tests/diagnose_logs/scripts/fr_capture.py): rank 0 enqueued all_reduce #2,
    rank 1 never did."""
    lines = flight_recorder_from_run(LOGS / "cpu" / "flight_recorder")
    assert "flight recorder: rank 0's last collective is #2 all_reduce [[4]] (scheduled)" in lines
    assert lines[-1] == "flight recorder: rank(s) 1 never enqueued collective #2 (all_reduce) that rank(s) 0 wait in"


def test_flight_recorder_reader_refuses_code_and_reads_json(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "fr_trace_rank0"
    bad.write_bytes(pickle.dumps({"entries": [Evil()]}))
    assert read_flight_recorder(bad) is None
    good = tmp_path / "fr_trace_rank1"
    good.write_text(json.dumps({"version": "2.10", "entries": [{"collective_seq_id": 3,
                                                                "profiling_name": "nccl:broadcast"}]}))
    assert read_flight_recorder(good)["entries"][0]["collective_seq_id"] == 3


def test_shim_sets_the_flight_recorder_and_dumps_stacks_on_sigusr1(tmp_path):
    """A rank under the shim: the flight recorder's variables are set before torch is imported where a GPU is
    possible (none on a CPU node: gloo never dumps it), and ``rankshim.py --dump-stacks`` gets the stack of a rank
    sleeping in the script."""
    import os
    import subprocess
    import time

    from broker.run import rankshim
    from broker.run.launch import RANKSHIM

    script = tmp_path / "train.py"
    script.write_text("import os, time\nprint(os.environ.get('TORCH_FR_BUFFER_SIZE') or "
                      "os.environ.get('TORCH_NCCL_TRACE_BUFFER_SIZE') or 'unset', flush=True)\n"
                      "time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    p = subprocess.Popen([sys.executable, str(RANKSHIM), "--facts", str(tmp_path / "facts"), "--", "train.py"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == ("2000" if rankshim.gpu_possible(env) else "unset")
        time.sleep(0.5)
        out = subprocess.run([sys.executable, str(RANKSHIM), "--dump-stacks", str(tmp_path / "facts"),
                              "--no-py-spy"], capture_output=True, text=True, timeout=60)
        d = stack_answers(out.stdout)
        assert all(len(ln) < 1024 for ln in out.stdout.splitlines()), out.stdout
        assert d["0"]["tool"] == "faulthandler" and d["0"]["code"]["train.py:3"] == "time.sleep(60)"
        pl = places_from_sample(d)[0]
        assert pl.describe() == "rank 0 is in time.sleep at train.py:3"
        facts = json.loads((tmp_path / "facts" / "rank0.json").read_text())
        assert facts["stack_file"] == "rank0.stack"
    finally:
        p.kill()
        p.wait()


def _armed_env(tmp_path, monkeypatch, **extra) -> dict:
    """The TORCH_* variables the shim's diagnostics leave in a rank's environment on a node with a GPU device
    (a file standing for /dev/nvidiactl), ``extra`` set before; run in this process, its signal handler undone."""
    import faulthandler
    import os

    from broker.run import rankshim

    gpu = tmp_path / "nvidiactl"
    gpu.write_text("")
    for k in [k for k in os.environ if k.startswith("TORCH_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for k, v in extra.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(rankshim, "GPU_DEVICES", (str(gpu),))
    monkeypatch.setattr(rankshim._rec, "_PATH", str(tmp_path / "rank0.json"))
    try:
        rankshim._arm_diagnostics(str(tmp_path), 0)
    finally:
        faulthandler.unregister(rankshim.STACK_SIGNAL)
        if rankshim._STACK_FILE is not None:
            rankshim._STACK_FILE.close()
            monkeypatch.setattr(rankshim, "_STACK_FILE", None)
    return {k: v for k, v in os.environ.items() if k.startswith("TORCH_")}


def test_the_flight_recorder_is_armed_only_where_a_gpu_is_possible(tmp_path, monkeypatch):
    """A CPU node (CUDA_VISIBLE_DEVICES empty, as broker gives it, or no GPU device at all) runs gloo, whose flight
    recorder is never dumped yet records every collective (0.25-0.3 s of the 4.7 s main job): not armed there.  A
    node with a GPU device gets it, and the user's own setting still wins."""
    import os
    import subprocess

    from broker.run import rankshim
    from broker.run.launch import RANKSHIM

    gpu = tmp_path / "nvidiactl"
    gpu.write_text("")
    assert not rankshim.gpu_possible({"CUDA_VISIBLE_DEVICES": ""}, devices=(str(gpu),))
    assert not rankshim.gpu_possible({"CUDA_VISIBLE_DEVICES": "-1"}, devices=(str(gpu),))
    assert not rankshim.gpu_possible({}, devices=(str(tmp_path / "none"),))
    assert rankshim.gpu_possible({}, devices=(str(gpu),))
    assert rankshim.gpu_possible({"CUDA_VISIBLE_DEVICES": "1"}, devices=(str(tmp_path / "none"), str(gpu)))

    script = tmp_path / "train.py"
    script.write_text("import os\nprint(sorted(k for k in os.environ if k.startswith('TORCH_')))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(RANKSHIM), "--facts", str(tmp_path / "cpu"), "--", "train.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out

    # with a GPU device present: armed, the dump into the facts folder
    seen = _armed_env(tmp_path, monkeypatch)
    assert "2000" in seen.values() and seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert str(tmp_path / "fr_trace_rank") in seen.values()


def test_a_failed_runs_diagnosis_carries_the_flight_recorder(tmp_path):
    """A failed run (no stall) with the recorder's dumps in its facts folders: the diagnosis names the rank
    behind, after the failure itself."""
    import shutil

    from broker.run.diagnose import explain

    shutil.copytree(LOGS / "cpu" / "gloo_timeout", tmp_path / "run")
    for i in (0, 1):
        shutil.copy(LOGS / "cpu" / "flight_recorder" / f"node{i}" / "facts" / f"fr_trace_rank{i}",
                    tmp_path / "run" / f"node{i}" / "facts")
    res = SimpleNamespace(status="failed", exit_codes={0: 1, 1: -15},
                          log_paths={i: tmp_path / "run" / f"node{i}.log" for i in (0, 1)})
    lines = explain(tmp_path / "run", res, 2).lines()
    assert lines[-1] == "flight recorder: rank(s) 1 never enqueued collective #2 (all_reduce) that rank(s) 0 wait in"


def test_broker_run_pipeline_uses_the_recipes_stall_s_and_exits_1_with_the_places(tmp_path, monkeypatch):
    """The recipe's stall_s reaches the local executor through the pipeline; the run record and the diagnosis
    say where each rank was; the job's exit code is 1 (the job failed), not the deadline's."""
    pytest.importorskip("torch")
    import shutil

    from broker.money.ledger import Ledger
    from broker.run.runrecord import Hooks
    from broker.run.targets import LocalTarget
    from broker.run.pipeline import run_pipeline
    from broker.core.recipe import load_recipe

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(FAULT, job / "fault.py")
    (job / "r.yaml").write_text("name: hang\nscript: fault.py\nargs: [hang]\nnodes: 2\ncpu_ok: true\n"
                                "gpus_per_node: 0\nmax_hours: 0.05\nstall_s: 5\n"
                                "env: {FAULT_TIMEOUT_S: '600', CUDA_VISIBLE_DEVICES: ''}\n")
    recipe = load_recipe(job / "r.yaml")
    assert (recipe.stall_s, recipe.on_stall) == (5, "stop")
    out = run_pipeline(recipe, LocalTarget(recipe), ledger=Ledger(), hooks=Hooks(echo=None))
    assert out.exit_code == 1 and out.result.status == "failed", out.result.reason
    assert out.result.diagnosis[0].startswith("stalled: rank 0 waits in all_reduce at fault.py:")
    assert "rank 1 never called all_reduce: it is in time.sleep" in out.result.diagnosis[0]
    assert (Path(out.run.run_dir) / "diagnosis.txt").read_text().startswith("stalled: ")


def test_a_deadline_report_says_where_every_rank_was(tmp_path, monkeypatch):
    """stall_s longer than the deadline: the deadline stops the hang, and its report is not empty: one stack
    sample names both ranks' places, and no node is blamed."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from tests.support.runs import DeadlineNow, run_local

    # the deadline comes 2 s after both ranks said they started (rank 0 then waits in all_reduce, rank 1 sleeps),
    # however long start-up took; the spec's own 120 s is only the backstop
    deadline = DeadlineNow(monkeypatch)
    started: set[str] = set()

    def echo(line: str) -> None:
        for rank in ("0", "1"):
            if f"rank {rank}: started" in line:
                started.add(rank)
        if len(started) == 2:
            deadline.after(2)

    res = run_local(_hang_spec(600, "stop", 120), tmp_path / "run", echo=echo)
    assert res.status == "deadline" and deadline.fired_at is not None, res.reason
    text = "\n".join(explain(tmp_path / "run", res, 2).lines())
    assert text.startswith("at the deadline: rank 0 waits in all_reduce at fault.py:"), text
    assert "rank 1 never called all_reduce: it is in time.sleep" in text and "failed first" not in text
    assert "the deadline passed: broker stopped every node" in text


# ------------------------------------------------------------------------------------------------ known waits spin
def _sync_entry(rank, cpu_s, t, line=59):
    """Rank waiting for NCCL inside torch.cuda.synchronize (1x H200, bench/results/h200x1_hang_nccl.txt): it spins."""
    text = ("Current thread 0x1 (most recent call first):\n"
            '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1162 in synchronize\n'
            f'  File "faults.py", line {line} in <module>\n')
    return {"node": rank, "tool": "faulthandler", "text": text, "code": {f"faults.py:{line}": "torch.cuda.synchronize()"},
            "cpu_s": cpu_s, "t": t}


def _wait_entry(rank, cpu_s, t, line=70):
    """A user's ``work.wait()``: a C++ method, no Python frame below the user's line."""
    e = {"node": rank, "tool": "faulthandler", "text": "Current thread 0x1 (most recent call first):\n"
         f'  File "train.py", line {line} in <module>\n', "code": {f"train.py:{line}": "work.wait()"},
         "cpu_s": cpu_s, "t": t}
    return e


def _sleep_entry(rank, cpu_s, t):
    e = _entry(rank, None, 33, "time.sleep(600)")
    e.update(cpu_s=cpu_s, t=t)
    return e


@pytest.mark.parametrize("waiting", [_sync_entry, _wait_entry])
def test_a_rank_spinning_in_a_known_wait_is_waiting_not_busy(waiting):
    """The real NCCL hang: rank 0 spins a core in torch.cuda.synchronize (or work.wait()) for a collective rank 1
    never enqueued; it was 'computing, not stuck' and the run hung to the caller's timeout.  Now: stalled."""
    samples = [{"0": waiting(0, 10.0, 100.0), "1": _sleep_entry(1, 1.0, 100.0)},
               {"0": waiting(0, 13.0, 103.0), "1": _sleep_entry(1, 1.0, 103.0)}]
    clock = _Clock()
    said: list[str] = []
    w = StallWatch(5, lambda: samples.pop(0), clock=clock, gap_s=0, echo=said.append)
    clock.t = 6
    assert w.check(), said
    assert not any("computing, not stuck" in s for s in said), said
    assert w.reason.split("; ")[1].startswith("rank 0 waits in ") and "rank 1" in w.reason, w.reason


def test_every_rank_spinning_in_synchronize_is_stalled_too():
    samples = [{"0": _sync_entry(0, 10.0, 100.0), "1": _sync_entry(1, 10.0, 100.0)},
               {"0": _sync_entry(0, 13.0, 103.0), "1": _sync_entry(1, 13.0, 103.0)}]
    clock = _Clock()
    w = StallWatch(5, lambda: samples.pop(0), clock=clock, gap_s=0)
    clock.t = 6
    assert w.check() and w.found is not None


def test_a_run_judged_busy_is_judged_again_after_each_stall_s():
    """Busy once is not busy for ever: after a further stall_s of silence the ranks are sampled again; when the
    busy rank has stopped using CPU the run is stalled, and the silence reported counts from the last output."""
    def pair(cpu_a, cpu_b, t):
        e0, e1 = _entry(0, "all_reduce", 40), _entry(1, None, 33, "x = step(batch)")
        e0.update(cpu_s=1.0, t=t)
        e1.update(cpu_s=cpu_a, t=t)
        return [{"0": e0, "1": e1}, {"0": dict(e0, t=t + 3), "1": dict(e1, cpu_s=cpu_b, t=t + 3)}]

    samples = pair(5.0, 7.5, 100.0) + pair(7.5, 10.0, 110.0) + pair(10.0, 10.01, 120.0)
    clock = _Clock()
    said: list[str] = []
    w = StallWatch(10, lambda: samples.pop(0), clock=clock, gap_s=0, echo=said.append)
    clock.t = 10
    assert not w.check() and len(samples) == 4  # busy: not stopped
    clock.t = 15
    assert not w.check() and len(samples) == 4  # judged busy 5 s ago: not sampled again yet
    clock.t = 20
    assert not w.check() and len(samples) == 2  # judged again, still busy, said again
    assert sum("computing, not stuck" in s for s in said) == 2, said
    clock.t = 30
    assert w.check() and not samples  # no longer computing: stalled
    assert "no output for 30 s" in w.reason, w.reason


def test_flight_recorder_variable_names_follow_the_installed_torch(tmp_path, monkeypatch):
    """torch 2.11 warns on every rank that TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated: the shim sets the name the
    installed torch reads (from its metadata, no torch import) and keeps a user's own setting under either name."""
    import importlib.metadata

    from broker.run.rankshim import fr_env_names

    assert fr_env_names("2.11.0+cu130") == ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
    assert fr_env_names("2.13.0+cpu") == ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE")
    assert fr_env_names("2.5.1") == ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    assert fr_env_names(None) == ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    want = fr_env_names(importlib.metadata.version("torch"))
    (tmp_path / "a").mkdir()
    seen = _armed_env(tmp_path / "a", monkeypatch)
    assert seen[want[0]] == "2000" and seen[want[1]].endswith("fr_trace_rank")
    old = {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE",
           "TORCH_FR_DUMP_TEMP_FILE"} - set(want)
    assert not old & set(seen), seen  # only the names this torch reads: no deprecation warning on every rank
    (tmp_path / "b").mkdir()
    mine = _armed_env(tmp_path / "b", monkeypatch, TORCH_NCCL_TRACE_BUFFER_SIZE="50",
                      TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/tmp/mine")
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/tmp/mine"
    assert "TORCH_FR_BUFFER_SIZE" not in mine and "TORCH_FR_DUMP_TEMP_FILE" not in mine


def _answer(rank: str, frames: int) -> dict:
    text = "Current thread 0x1 (most recent call first):\n" + "".join(
        f'  File "/very/long/path/to/site-packages/torch/distributed/module_{i}.py", line {i} in f{i}\n'
        for i in range(frames))
    return {rank: {"pid": 100 + int(rank), "node": int(rank), "tool": "faulthandler", "text": text,
                   "code": {"train.py:9": "dist.all_reduce(t)"}, "cpu_s": 1.5, "t": 1.0}}


def test_answers_of_two_nodes_interleaved_mid_line_by_srun_are_put_back_together():
    """srun sends a task's line longer than 1024 bytes in pieces and mixes the pieces of its tasks: two nodes'
    one-line JSON answers arrived as '..."c{"1": {...' and no stack was read, so a Slurm hang ran to its deadline.
    The shim's answer is framed in short tagged lines; any order of those lines gives both answers back."""
    import random

    from broker.run.rankshim import frame_answer

    a, b = _answer("0", 40), _answer("1", 25)
    la, lb = frame_answer(json.dumps(a)).splitlines(), frame_answer(json.dumps(b)).splitlines()
    assert len(la) > 3 and all(len(ln) < 1024 for ln in la + lb)
    rng = random.Random(7)
    for _ in range(20):
        lines = la + lb + ["srun: warning: a line of srun's own", "not json {"]
        rng.shuffle(lines)
        assert stack_answers("\n".join(lines)) == {**a, **b}
    # the old one-line form, cut and interleaved as it was seen, gives nothing, and so does a lost line
    whole_a, whole_b = json.dumps(a), json.dumps(b)
    assert stack_answers(whole_a[:1000] + whole_b + whole_a[1000:]) == {}
    assert stack_answers("\n".join(la[:-1] + lb)) == b


def test_a_damaged_or_inconsistent_answer_line_is_left_out():
    from broker.run.rankshim import frame_answer

    a = _answer("0", 30)
    lines = frame_answer(json.dumps(a)).splitlines()
    tag, ident, pos, chunk = lines[0].split(" ", 3)
    assert stack_answers("\n".join([f"{tag} {ident} 1/9 {chunk}"] + lines[1:])) == {}  # counts disagree
    assert stack_answers("\n".join([f"{tag} {ident} x/y {chunk}"] + lines[1:])) == {}
    assert stack_answers("\n".join([f"{tag} {ident} {pos} {chunk[:-3]}"] + lines[1:])) == {}  # not JSON
    assert stack_answers("\n".join(lines)) == a


def test_an_answer_whose_chunks_begin_or_end_with_a_space_comes_back_whole():
    """JSON's ', ' separators fall on chunk boundaries: the lines are taken as they are (a stripped line lost a
    node's answer, 'no stack from rank(s) 1')."""
    from broker.run.rankshim import ANSWER_CHUNK, frame_answer

    edges = 0
    for shift in range(8):
        words = " ".join(["x" * 7] * (3 * ANSWER_CHUNK // 8))
        a = {"1": {"pid": 1, "node": 1, "tool": "faulthandler", "text": "y" * shift + words, "code": {}}}
        lines = frame_answer(json.dumps(a)).splitlines()
        edges += sum(ln.endswith(" ") or ln.split(" ", 3)[3].startswith(" ") for ln in lines)
        assert stack_answers("\n".join(lines)) == a, shift
    assert edges  # some chunk did begin or end with a space


# ------------------------------------------------------------------------------------------------ start-up hangs
def _script_spec(script: str, stall_s: float, deadline_s: float, on_stall: str = "stop", args=()):
    from broker.run.launch import LocalLaunchSpec

    return LocalLaunchSpec(script_rel=script, args=list(args), workdir=FAULT.parent, nnodes=2, nproc_per_node=1,
                           env={"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}, node_envs=[{}, {}],
                           setup=[], expect=[], deadline_s=deadline_s, stall_s=stall_s, on_stall=on_stall)


@pytest.mark.slow
def test_a_rendezvous_the_script_moved_is_named_on_time_without_interrupting_the_ranks(tmp_path):
    """The script sets MASTER_ADDR/PORT itself: every rank waits in init_process_group for an address no one
    listens on.  Named after stall_s (not after torch's growing connect retries), with both addresses and the lines
    to delete; the watch never signals a rank in the rendezvous, so torch logs no "Interrupted system call" retry
    (each one, with ~45 C++ frames, used to reset the silence), and the silence figure is the real one."""
    pytest.importorskip("torch")
    from tests.support.runs import run_local

    src = (FAULT.parent / "rdv_master_env.py").read_text().splitlines()
    sets = [i + 1 for i, ln in enumerate(src) if ln.startswith("os.environ[\"MASTER_")]
    init = next(i + 1 for i, ln in enumerate(src) if "init_process_group(" in ln)
    lines: list[str] = []
    res = run_local(_script_spec("rdv_master_env.py", 4, 120), tmp_path / "run", echo=lines.append)
    assert res.status == "failed", (res.reason, lines[-20:])
    want = (f"every rank waits in init_process_group at rdv_master_env.py:{init} for 127.0.0.1:29533, but "
            f"torchrun's rendezvous is at 127.0.0.1:")
    assert want in res.reason and f"lines {sets[0]}-{sets[-1]} of rdv_master_env.py set MASTER_ADDR/PORT: " \
        f"delete them" in res.reason, res.reason
    assert "no output for 0 s" not in res.reason and "no output for 0 s" not in "\n".join(lines)
    logs = "".join((tmp_path / "run" / f"node{i}.log").read_text() for i in (0, 1))
    assert "Interrupted system call" not in logs, logs[-2000:]


def test_silence_ignores_the_retry_a_signal_makes_torch_print():
    """torch's EINTR retry line and the C++ trace under it are not output; the next real line is."""
    from broker.run.stall import _Timed

    class Node:
        def lines(self):
            yield "[W1206 TCPStore.cpp:340] [c10d] TCP client failed to connect ...: Interrupted system call"
            yield "Exception raised from delay at socket.cpp:113 (most recent call first):"
            yield "frame #0: c10::Error::Error(...) + 0x9d (0x7f in libc10.so)"
            yield "<omitting python frames>"
            yield ""
            yield "epoch 1 loss 0.5"

    clock = _Clock()
    watch = StallWatch(5, lambda: {}, clock=clock)
    node = watch.wrap([Node()])[0]
    it = node.lines()
    for _ in range(5):
        clock.t += 10
        next(it)
    assert watch.last_output == 0.0
    clock.t += 10
    next(it)
    assert watch.last_output == clock.t


def test_an_init_method_on_localhost_across_two_hosts_is_named():
    """Two hosts, init_method tcp://127.0.0.1:29511 in the script: each host looks for rank 0 at itself."""
    def entry(rank, host):
        return {"pid": 10 + rank, "node": rank, "tool": "facts", "cpu_s": 1.0, "t": 5.0,
                "code": {"train.py:9": 'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511")'},
                "init": {"at": {"file": "train.py", "line": 9, "function": "<module>"}, "master": "10.0.0.2:29500",
                         "init_master": "10.0.0.2:29500", "init_method": "tcp://127.0.0.1:29511", "host": host}}
    v = verdict(places_from_sample({"0": entry(0, "a"), "1": entry(1, "b")}), 2)
    assert v.lines[0] == ("every rank waits in init_process_group at train.py:9 for 127.0.0.1:29511 "
                          "(init_method='tcp://127.0.0.1:29511'), but torchrun's rendezvous is at 10.0.0.2:29500; "
                          "the ranks run on 2 hosts, and each looks for rank 0 at its own address: drop init_method "
                          "from the call at train.py:9"), v.lines


# ------------------------------------------------------------------------------------------------ no false alarms
@pytest.mark.slow
def test_every_rank_preprocessing_silently_on_a_loaded_machine_is_not_a_stall(tmp_path):
    """A correct script: after init every rank computes in its own code at one line, printing nothing, before
    its first collective, at nice 19 beside two spinning processes (one per core of a 2-core machine): each rank
    gets ~1-10 % of a core (under the old 20 % share it was stopped as a stall), but it is runnable the whole
    time.  Not stopped; it ends by itself."""
    pytest.importorskip("torch")
    import subprocess
    from dataclasses import replace
    from tests.support.runs import run_local

    spin = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end: pass\n"
    load = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        spec = _script_spec("ok_slow_start.py", 3, 180)
        spec = replace(spec, env={**spec.env, "PREP_S": "12", "PREP_NICE": "19"})
        lines: list[str] = []
        res = run_local(spec, tmp_path / "run", echo=lines.append)
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert res.status == "succeeded", (res.reason, lines[-20:])
    assert not (tmp_path / "run" / "stall.json").exists()
    assert not any("stalled" in ln for ln in lines), lines


def test_a_rank_runnable_but_starved_of_cpu_is_busy():
    """Little CPU used (a loaded machine) but runnable, waiting for a CPU most of the gap: computing.  No CPU and
    no wait: blocked."""
    from broker.run.stall import busy_ranks

    def pl(rank, cpu, wait, t):
        return SimpleNamespace(rank=rank, cpu_s=cpu, wait_s=wait, t=t)

    first = [pl(0, 1.0, 5.0, 100.0), pl(1, 1.0, 5.0, 100.0)]
    second = [pl(0, 1.02, 8.3, 103.5), pl(1, 1.01, 5.0, 103.5)]
    assert busy_ranks(first, second) == {0}


# ------------------------------------------------------------------------------------------------ collective sequences
@pytest.mark.slow
def test_a_barrier_only_rank_0_reaches_is_named_with_its_line_and_where_the_others_are(tmp_path):
    """`if rank == 0: dist.barrier()` in a DDP loop: rank 0 waits in the barrier, rank 1 in its next backward().
    It used to be called uneven data per rank ("left the training loop"); the shim's sequence of collectives names
    the barrier, its line, the rank that reached it and where the other is."""
    pytest.importorskip("torch")
    from tests.support.runs import run_local

    src = (FAULT.parent / "barrier_rank0.py").read_text().splitlines()
    bar = next(i + 1 for i, ln in enumerate(src) if ln.strip() == "dist.barrier()")
    bwd = next(i + 1 for i, ln in enumerate(src) if ".backward()" in ln)
    res = run_local(_script_spec("barrier_rank0.py", 4, 120), tmp_path / "run", echo=None)
    assert res.status == "failed", res.reason
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    assert st["cause"].startswith(f"barrier at barrier_rank0.py:{bar} (collective #3), under `if rank == 0 and "
                                  f"step == 1:` (line {bar - 1}), was reached only by rank(s) 0; rank 1 waits in "
                                  f"backward()"), st["cause"]
    assert f"at barrier_rank0.py:{bwd}" in st["cause"] and "different numbers of batches" not in st["cause"]
    assert any(f"rank 0 left the common path there (barrier at barrier_rank0.py:{bar}" in ln for ln in st["lines"])


def _seq(*sigs):
    table = sorted(set(sigs))
    return {"sigs": [list(s) for s in table], "seq": [table.index(s) for s in sigs], "total": len(sigs)}


FWD_T, BWD, FWD_E = ("DDP forward (buffer broadcast)", None, "t.py", 20), \
    ("backward (DDP gradient all-reduce)", None, "t.py", 21), ("DDP forward (buffer broadcast)", None, "t.py", 30)


@pytest.mark.parametrize("r0, r1, left, at", [
    # rank 0 evaluates through the DDP model after step 2; rank 1 goes on training: rank 0 left
    ((FWD_T, BWD, FWD_T, BWD, FWD_E), (FWD_T, BWD, FWD_T, BWD, FWD_T, BWD), [0], 5),
    # rank 1 skipped backward() for one batch: its forward follows a forward, a step no rank took before
    ((FWD_T, BWD, FWD_T, BWD, FWD_T, BWD), (FWD_T, BWD, FWD_T, FWD_T, BWD), [1], 4),
])
def test_the_rank_that_left_the_common_path_is_named(r0, r1, left, at):
    from broker.run.stall import sequence_divergence

    d = sequence_divergence({0: _seq(*r0), 1: _seq(*r1)})
    assert d is not None and d["index"] == at and d["left"] == left, d


def test_equal_sequences_and_a_cut_sequence_name_nothing():
    from broker.run.stall import sequence_divergence

    assert sequence_divergence({0: _seq(FWD_T, BWD), 1: _seq(FWD_T, BWD)}) is None
    cut = dict(_seq(FWD_T), total=5)
    assert sequence_divergence({0: cut, 1: _seq(FWD_T, BWD, FWD_T)}) is None


@pytest.mark.slow
def test_a_dataloader_worker_stuck_in_the_dataset_is_named_with_its_line(tmp_path):
    """Rank 1's DataLoader workers wait in the dataset's __getitem__ for a file nobody writes; rank 1 waits for a
    batch, rank 0 in backward().  The rank's own stack shows only the DataLoader's queue ("at worker_stuck.py:36,
    inside select"); the workers' stacks (the shim's faulthandler, inherited across the fork; no py-spy) name the
    worker's line and call."""
    pytest.importorskip("torch")
    from broker.run.diagnose import explain
    from tests.support.runs import run_local

    src = (FAULT.parent / "worker_stuck.py").read_text().splitlines()
    sleep_at = next(i + 1 for i, ln in enumerate(src) if ln.strip() == "time.sleep(0.2)")
    loop_at = next(i + 1 for i, ln in enumerate(src) if ln.startswith("for x in loader"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    lines: list[str] = []
    res = run_local(_script_spec("worker_stuck.py", 6, 120, args=[str(scratch)]), tmp_path / "run", echo=lines.append)
    assert res.status == "failed" and res.reason.startswith("stalled:"), res.reason
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    want = (f"rank 1 never called backward(): it is waiting for a batch from its DataLoader at worker_stuck.py:"
            f"{loop_at} (for x in loader:); its worker (pid ")
    assert want in st["lines"][0] and f"is in time.sleep at worker_stuck.py:{sleep_at} in __getitem__" \
        in st["lines"][0], st["lines"]
    assert st["cause"].startswith("rank(s) 1 wait for a batch their DataLoader never delivers: rank 1's worker (pid "), \
        st["cause"]
    assert f"look at worker_stuck.py:{sleep_at}" in st["fix"], st["fix"]
    assert "DataLoader worker (pid" in (tmp_path / "run" / "stacks.txt").read_text()
    text = "\n".join(explain(tmp_path / "run", res, 2).lines())
    assert f"time.sleep at worker_stuck.py:{sleep_at} in __getitem__" in text.splitlines()[0], text


def test_a_ranks_child_that_is_another_program_is_never_signalled(tmp_path):
    """The workers' stacks come from SIGUSR1 to the rank's children: only forks of the rank (its command line, the
    faulthandler it armed) get it.  A child that exec'd another program (`sleep`: SIGUSR1 would end it; a Python
    program with its own SIGUSR1 handler) is left alone, while a forked child answers."""
    import os
    import signal
    import subprocess

    from broker.run import rankshim_stacks

    rank = tmp_path / "rank.py"
    rank.write_text(
        "import faulthandler, os, signal, subprocess, sys, time\n"
        "f = open(sys.argv[1], 'a')\n"
        "faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: "
        "open(sys.argv[1], \"w\").close()); print(flush=True); time.sleep(60)', sys.argv[1] + '.handled'], "
        "stdout=subprocess.PIPE).stdout.readline()  # its handler is installed\n"
        "if os.fork() == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n")
    stack = tmp_path / "rank0.stack"
    p = subprocess.Popen([sys.executable, str(rank), str(stack)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        kids = rankshim_stacks._children(p.pid)
        assert len(kids) == 3, kids
        got = rankshim_stacks._worker_stacks(str(tmp_path), {"pid": p.pid, "stack_file": stack.name}, None)
        assert len(got) == 1 and "rank.py" in got[0]["text"], got
        assert all(rankshim_stacks._alive(k) for k in kids)  # sleep and the other program were never signalled
        assert not (tmp_path / "rank0.stack.handled").exists()
    finally:
        for k in rankshim_stacks._children(p.pid):
            os.kill(k, signal.SIGKILL)
        p.kill()
        p.wait()
