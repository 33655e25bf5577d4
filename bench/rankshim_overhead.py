"""What the rank shim's recording costs, measured so that a loaded machine cannot hide or invent it.

Whole runs with and without the shim swing by tens of percent on a shared machine (another job's burst lands in
one run and not in the other), so the pairs here are *inside one run*: 2 ranks through torchrun, both behind
``rankshim.py --facts DIR`` (facts, collective sequence with calling lines, DDP forward/backward sync points,
sampler and DataLoader records, the facts-saver thread), train a book-style DDP loop (DistributedSampler with
set_epoch, DataLoader, DDP, SGD, a logging all_reduce per step) in blocks of ``--block`` steps (one epoch of the
loader each).  Before each block both ranks switch the shim's recording on or off together (every function the shim
wrapped is swapped with its ``__wrapped__`` original), in pairs whose order alternates (off-on, on-off, ...).
Adjacent blocks take ~0.1 s each, so they see the same load; the per-pair ratio on/off, for the block's wall time and
for the rank process's CPU time, is the measurement.  The result is the median of the ratios with a bootstrap 95 %
confidence interval (2000 resamples).

On a loaded machine those pairs still spread by +-20 %, so the figure that decides is the shim's own time: the
wrappers of one training step (DataLoader record, DDP forward and backward() sync points, the all_reduce record)
around no-op originals against the originals alone, alternated in this process and timed in thread CPU time (no
other process's load enters it), median and bootstrap CI per step, divided by the fastest step without recording
seen in the run.  Added to it: the facts writes (the saver thread's CPU per write, at most SAVE_SHARE of the time by
its own pacing).  The end-of-run parameter checksums run once, after training, and are not a per-step cost.

    python bench/rankshim_overhead.py [--pairs 40] [--block 20] [--hidden 256] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (stdlib only: the benchmark runs where only torch is installed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAIN = '''
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

pairs, block, hidden, batch = (int(a) for a in sys.argv[1:5])
dist.init_process_group("gloo")
torch.manual_seed(0)
ds = TensorDataset(torch.randn(block * batch * dist.get_world_size(), hidden))
sampler = DistributedSampler(ds)
loader = DataLoader(ds, batch_size=batch, sampler=sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
    torch.nn.Linear(hidden, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)

# every (owner, name) the shim wraps in a training step, with its wrapper and the original (__wrapped__)
owners = [(dist, n) for n in ("all_reduce", "barrier")] + [
    (torch.nn.parallel.DistributedDataParallel, "forward"), (torch.Tensor, "backward"),
    (DataLoader, "__iter__"), (DistributedSampler, "set_epoch")]
swaps = []
for owner, name in owners:
    fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    if getattr(fn, "_broker", False):
        swaps.append((owner, name, fn, fn.__wrapped__))
assert len(swaps) == len(owners), "run it behind rankshim.py: %d of %d wrapped" % (len(swaps), len(owners))


def recording(on):
    for owner, name, wrapper, orig in swaps:
        setattr(owner, name, wrapper if on else orig)


def epoch(e):
    sampler.set_epoch(e)
    for (x,) in loader:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        dist.all_reduce(loss.detach())  # a logging collective every step: the sequence records each one


recording(True)
epoch(0)  # warm-up (first call sites interned, the saver thread started)
rows = []
for p in range(pairs):
    for on in ((False, True) if p % 2 == 0 else (True, False)):
        recording(on)
        w0, c0 = time.perf_counter(), time.process_time()
        epoch(1 + len(rows))
        rows.append([p, on, time.perf_counter() - w0, time.process_time() - c0])
recording(True)
print("BLOCKS " + json.dumps(rows), flush=True)
'''


def run(pairs: int, block: int, hidden: int, batch: int) -> tuple[dict[int, list], dict]:
    """One 2-rank torchrun job behind the shim: ``({rank: rows}, rank 0's facts)``."""
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "train.py"
        script.write_text(TRAIN)
        facts = os.path.join(d, "facts")
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                   f"--node_rank={i}", "--master_addr=127.0.0.1", f"--master_port={port}",
                                   str(REPO / "broker" / "run" / "rankshim.py"), "--facts", facts, "--",
                                   str(script), str(pairs), str(block), str(hidden), str(batch)],
                                  cwd=d, env={**env, "BROKER_NODE_RANK": str(i)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        outs = [p.communicate(timeout=1800) for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"run failed {[p.returncode for p in procs]}: {outs[0][1][-2000:]}")
        rows = {}
        for i, (out, _) in enumerate(outs):
            line = next(ln for ln in out.splitlines() if ln.startswith("BLOCKS "))
            rows[i] = json.loads(line[len("BLOCKS "):])
        fact = json.loads(Path(facts, "rank0.json").read_text())
    return rows, fact


def ratios(rows: list, col: int) -> list[float]:
    by: dict[int, dict[bool, float]] = {}
    for p, on, wall, cpu in rows:
        by.setdefault(p, {})[on] = (wall, cpu)[col]
    return [v[True] / v[False] for v in by.values() if v.get(False)]


def median_ci(xs: list[float], n: int = 2000, seed: int = 1) -> tuple[float, float, float]:
    rnd = random.Random(seed)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def save_cost(fact: dict, repeat: int = 50) -> float:
    """CPU seconds (this thread's) one facts write of this size takes here (json's C encoder + write + rename, as
    _save does): what the saver thread takes from the rank; it paces itself on the same figure."""
    import time

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rank0.json")
        t0 = time.thread_time()
        for _ in range(repeat):
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(json.dumps(fact, indent=None, default=str))
            os.replace(tmp, path)
        return (time.thread_time() - t0) / repeat


def hook_cost_per_step(pairs: int = 60, block: int = 2000) -> tuple[float, float, float]:
    """The shim's own CPU time per training step, in seconds ``(median, low, high 95 %)``: the wrappers of one
    step (the DataLoader's per-batch record, the DDP forward's and backward()'s sync points, a logging
    ``all_reduce``) around no-op originals, against the no-op originals alone, in alternated blocks of ``block``
    steps in this process, timed in thread CPU time (another process's load does not enter it).  This is the
    shim's code and nothing else: no torch work, no network."""
    import time
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO))
    from broker.run import rankshim_record as rankshim

    class DDP:
        module = None
        require_backward_grad_sync = True

        def forward(self, *a, **k):
            return None

        def will_sync_module_buffers(self):
            return False

    class Tensor:
        shape, dtype = (1,), "float32"

        def backward(self, *a, **k):
            return None

    class Loader:
        dataset, sampler = range(block), None

        def __iter__(self):
            return iter(self.items)

    t = Tensor()
    Loader.items = [t] * block
    fake = SimpleNamespace(nn=SimpleNamespace(parallel=SimpleNamespace(DistributedDataParallel=DDP)), Tensor=Tensor,
                           is_grad_enabled=lambda: True, utils=SimpleNamespace(data=SimpleNamespace(DataLoader=Loader)),
                           optim=SimpleNamespace())
    orig = {"forward": DDP.forward, "backward": Tensor.backward, "iter": Loader.__iter__}
    noop_reduce = lambda x, *a, **k: None  # noqa: E731
    rankshim._patch_data(fake)
    shimmed = {"forward": DDP.forward, "backward": Tensor.backward, "iter": Loader.__iter__,
               "reduce": rankshim._counted("all_reduce", noop_reduce)}
    orig["reduce"] = noop_reduce
    model, loader = DDP(), Loader()

    def steps(fns):
        DDP.forward, Tensor.backward, Loader.__iter__ = fns["forward"], fns["backward"], fns["iter"]
        reduce = fns["reduce"]
        seq = rankshim._FACTS.get("seq")
        if seq:  # below the sequence's cap again, as in the first minutes of a run (each point appended)
            seq["seq"].clear()
        c0 = time.thread_time()
        for x in loader:  # a training step's shim-visible calls, on the script's own line
            model.forward(x)
            x.backward()
            reduce(x)
        return time.thread_time() - c0

    steps(shimmed)  # warm-up: call sites interned
    diffs = []
    for p in range(pairs):
        got = {}
        for on in ((False, True) if p % 2 == 0 else (True, False)):
            got[on] = steps(shimmed if on else orig)
        diffs.append((got[True] - got[False]) / block)
    return median_ci(diffs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--block", type=int, default=20, help="steps per block (one epoch of the loader)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    rows, fact = run(a.pairs, a.block, a.hidden, a.batch)
    step_s = statistics.median(w for r in rows.values() for _, on, w, _ in r if not on) / a.block
    print(f"# {a.pairs} alternated off/on pairs of {a.block}-step blocks, 2 ranks (gloo), MLP hidden {a.hidden}, "
          f"batch {a.batch}; a step without recording takes {step_s * 1e3:.2f} ms (median)")
    verdicts = []
    for rank, r in sorted(rows.items()):
        for col, what in ((0, "wall"), (1, "CPU")):
            med, lo, hi = median_ci(ratios(r, col))
            verdicts.append(hi - 1)
            print(f"rank {rank} {what:4s}: recording on/off median {med - 1:+.2%}, 95% CI [{lo - 1:+.2%}, "
                  f"{hi - 1:+.2%}] ({len(ratios(r, col))} pairs)")
    off = [w for _, on, w, _ in rows[0] if not on]
    on = [w for _, on, w, _ in rows[0] if on]
    per_step = (sum(on) - sum(off)) / len(on) / a.block
    print(f"rank 0: mean block {statistics.mean(off) * 1e3:.1f} ms off, {statistics.mean(on) * 1e3:.1f} ms on "
          f"({per_step * 1e6:+.0f} us a step)")
    med, lo, hi = hook_cost_per_step()
    fastest = min(w for r in rows.values() for _, on, w, _ in r if not on) / a.block
    print(f"the shim's own CPU time per step (its wrappers around no-op originals, thread CPU time, 60 alternated "
          f"pairs of 2000 steps): median {med * 1e6:.1f} us, 95% CI [{lo * 1e6:.1f}, {hi * 1e6:.1f}] us; against "
          f"the fastest step without recording here ({fastest * 1e3:.2f} ms): {hi / fastest:.2%} at the CI's upper "
          f"end")
    sys.path.insert(0, str(REPO))
    from broker.run.rankshim_record import _SAVE_EVERY_S, SAVE_SHARE

    w = save_cost(fact)
    share = min(w / _SAVE_EVERY_S, SAVE_SHARE)
    print(f"facts write ({len(json.dumps(fact))} bytes of JSON, the sequence at its cap): {w * 1e3:.2f} ms of CPU; "
          f"the saver pauses max({_SAVE_EVERY_S} s, write / {SAVE_SHARE}) between writes: <= {share:.2%} of the "
          "run's time")
    worst = hi / fastest + share
    print(f"verdict: the shim's own time {hi / fastest:.2%} of the fastest step (upper 95% bound) + facts writes "
          f"{share:.2%} = {worst:.2%}: {'within' if worst <= 0.02 else 'OVER'} the 2 % budget; the in-run on/off "
          f"pairs' widest upper bound is {max(verdicts):+.2%}")


if __name__ == "__main__":
    main()
