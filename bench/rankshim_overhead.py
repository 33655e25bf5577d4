"""What the rank shim's recording costs: the same 2-rank DDP training through torchrun, the script alone against the
script behind ``rankshim.py --facts DIR`` (facts, collective sequence with calling lines, DDP forward/backward
sync points, sampler and DataLoader records, the facts-saver thread, the end-of-run parameter checksums).

Each side reports the training loop's own time (printed by the script: start-up, torch's import and the
rendezvous are the same on both sides and are not the shim's recording) and the whole wall time.  Runs are paired
(the order swapped every pair) and the median of the per-pair ratios is the result, as in launch_overhead.py.
Goal: the recording costs at most 2 % of the loop.

    python bench/rankshim_overhead.py [--runs 3] [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (stdlib only: the benchmark runs where only torch is installed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

TRAIN = '''
import os, sys, time
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
dist.init_process_group("gloo")
torch.manual_seed(0)
steps = int(sys.argv[1])
ds = TensorDataset(torch.randn(steps * 8 * dist.get_world_size(), 64))
sampler = DistributedSampler(ds)
loader = DataLoader(ds, batch_size=8, sampler=sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                                      torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dist.barrier()
t0 = time.perf_counter()
sampler.set_epoch(0)
for (x,) in loader:
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    dist.all_reduce(loss.detach())  # a user collective every step: the sequence records each one
print("LOOP_S", time.perf_counter() - t0, flush=True)
'''


WORLD = [2]


def one(script: Path, steps: int, shim: bool) -> tuple[float, float]:
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as d:
        target = ([str(REPO / "broker" / "run" / "rankshim.py"), "--facts", os.path.join(d, "facts"), "--"]
                  if shim else []) + [str(script), str(steps)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={WORLD[0]}",
                                   "--nproc_per_node=1", f"--node_rank={i}", "--master_addr=127.0.0.1",
                                   f"--master_port={port}", *target],
                                  cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for i in range(WORLD[0])]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"run failed ({'shim' if shim else 'alone'}): {[p.returncode for p in procs]}")
    loops = [float(m.group(1)) for o in outs for m in [re.search(r"LOOP_S ([\d.]+)", o)] if m]
    return max(loops), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--world", type=int, default=2, help="ranks (1: no network in the step, so the share of the "
                    "recording is an upper bound)")
    a = ap.parse_args()
    WORLD[0] = a.world
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "train.py"
        script.write_text(TRAIN)
        loop_ratios, wall_ratios, loops = [], [], {False: [], True: []}
        for i in range(a.runs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {shim: one(script, a.steps, shim) for shim in order}
            (la, wa), (ls, ws) = got[False], got[True]
            loops[False].append(la)
            loops[True].append(ls)
            loop_ratios.append(ls / la)
            wall_ratios.append(ws / wa)
            print(f"pair {i + 1}: loop alone {la:.2f} s, with the shim {ls:.2f} s ({ls / la - 1:+.1%}); "
                  f"wall {wa:.1f} s / {ws:.1f} s ({ws / wa - 1:+.1%})", flush=True)
    print(f"median loop overhead {statistics.median(loop_ratios) - 1:+.1%} ({a.steps} steps of {a.world} rank(s), "
          f"each with a DDP backward and an all_reduce); fastest loops {min(loops[False]):.3f} s alone, "
          f"{min(loops[True]):.3f} s with the shim ({min(loops[True]) / min(loops[False]) - 1:+.1%}); median wall "
          f"overhead {statistics.median(wall_ratios) - 1:+.1%}")


if __name__ == "__main__":
    main()
