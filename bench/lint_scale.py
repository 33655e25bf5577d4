"""`broker lint` on one growing training script: time per file size against the 1k-line file in the same run.

The script is a realistic DDP file repeated: helpers that take a rank/device parameter, called from several places
(the shape that made the rank flow analysis quadratic: every parameter looked at every call of the file).  Sizes
alternate (1k, 5k, 10k, 1k, ...) so load drifts hit every size; the ratio of medians against the 1k file is
printed with the load average.  Goal: linear (10k ~ 10x the 1k file) and 10k lines <= 2 s.

    python bench/lint_scale.py [--rounds 3] [--sizes 1000,5000,10000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEADER = '''import os
import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
rank = int(os.environ["RANK"])
'''

BLOCK = '''

def setup_{i}(model, device_index, scale=1.0):
    x = torch.randn(4, 2).cuda(device_index)
    y = x * scale + {i}
    if device_index == 0:
        print("setup", {i}, y.sum())
    return model(x)


def save_{i}(state, who, path="ckpt_{i}.pt"):
    if who == 0:
        torch.save(state, path)
    return path


class Trainer{i}:
    def __init__(self, model, gpu):
        self.gpu = gpu
        self.model = model.to(gpu)

    def step(self, batch, step_no):
        out = self.model(batch.to(self.gpu))
        if step_no % 10 == 0:
            save_{i}(out, rank)
        return out


def run_{i}(model, batches):
    t = Trainer{i}(model, local_rank)
    for k, b in enumerate(batches):
        t.step(b, k)
    setup_{i}(model, local_rank)
    setup_{i}(model, device_index=local_rank, scale=2.0)
    save_{i}({{"k": {i}}}, who=rank)
    return t
'''


def script(lines: int) -> str:
    per = BLOCK.count("\n")
    return HEADER + "".join(BLOCK.format(i=i) for i in range(max(1, lines // per)))


def lint_seconds(path: Path) -> float:
    """CPU seconds (user + sys) of one `broker lint` subprocess on ``path``; CPU, not wall: the machine is shared."""
    code = ("import resource, sys\nfrom broker.lint.rules import lint_script\n"
            "lint_script(sys.argv[1])\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\nprint(r.ru_utime + r.ru_stime)")
    base = ("import resource\nimport astroid, broker.lint.rules\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\nprint(r.ru_utime + r.ru_stime)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO, check=True)
    imp = subprocess.run([sys.executable, "-c", base], capture_output=True, text=True, cwd=REPO, check=True)
    return float(out.stdout.split()[-1]) - float(imp.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1000,5000,10000")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if sizes[0] != 1000:
        sizes.insert(0, 1000)
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for s in sizes:
            p = Path(d) / f"train_{s}.py"
            p.write_text(script(s))
            files[s] = p
        times: dict[int, list[float]] = {s: [] for s in sizes}
        for _ in range(a.rounds):
            for s in sizes:
                times[s].append(lint_seconds(files[s]))
    base = statistics.median(times[1000])
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}  (lint CPU seconds, import excluded, "
          f"median of {a.rounds})")
    for s in sizes:
        med = statistics.median(times[s])
        print(f"{s:>6} lines  {med:6.2f} s  {med / base:6.1f}x the 1k file  (linear would be {s / 1000:.0f}x)"
              f"  runs {' '.join(f'{t:.2f}' for t in times[s])}")
    ok = statistics.median(times[sizes[-1]]) <= 2.0 if sizes[-1] == 10000 else None
    if ok is not None:
        print(f"goal 10k lines <= 2 s: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
