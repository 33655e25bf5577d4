"""Does broker lint stay linear in file size with the DDP rules (broker/lint/ddp.py)?

    .venv/bin/python bench/lint_ddp_scale.py

Generates flat DDP scripts of 1x and 4x the statements (an all_reduce per step, a rank-0 print every tenth) and
prints the time ratio 4x / 1x of the DDP rules alone and of the whole lint (the baseline, measured in the same
run): about 4 is linear, 16 quadratic.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.lint import ddp as lint_ddp
from broker.lint.script import lint_source  # noqa: E402


def script(n: int) -> str:
    body = ["import torch", "import torch.distributed as dist", "dist.init_process_group('gloo')",
            "rank = dist.get_rank()", "t = torch.ones(1)"]
    for i in range(n):
        body += [f"x{i} = t * {i}", f"dist.all_reduce(x{i})"]
        if i % 10 == 0:
            body.append(f"if rank == 0:\n    print(x{i})")
    return "\n".join(body) + "\n"


def rules_time(src: str, k: int = 3) -> tuple[float, float]:
    """(best whole-lint seconds, best seconds inside lint_ddp.check) over ``k`` runs."""
    spent = [0.0]
    orig = lint_ddp.check

    def timed(L):
        t = time.perf_counter()
        orig(L)
        spent[0] += time.perf_counter() - t

    whole, mine = [], []
    lint_ddp.check = timed
    try:
        for _ in range(k):
            spent[0] = 0.0
            t = time.perf_counter()
            lint_source(src, "bench.py")
            whole.append(time.perf_counter() - t)
            mine.append(spent[0])
    finally:
        lint_ddp.check = orig
    return min(whole), min(mine)


def main() -> None:
    small, big = script(500), script(2000)
    lint_source(small, "warm.py")
    w1, r1 = rules_time(small)
    w4, r4 = rules_time(big)
    print(f"lines {len(small.splitlines())} -> {len(big.splitlines())} (x4)")
    print(f"DDP rules: {r1:.3f} s -> {r4:.3f} s, ratio {r4 / r1:.1f} (4 = linear)")
    print(f"whole lint (baseline, same run): {w1:.2f} s -> {w4:.2f} s, ratio {w4 / w1:.1f}")


if __name__ == "__main__":
    main()
