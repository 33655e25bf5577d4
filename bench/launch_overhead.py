"""Launch overhead: `broker run recipes/ddp_2node.yaml` against the bare two-torchrun launch of the same script.

Both run the same training (same args and env) on this machine as two simulated nodes.  The baseline is what a
person types by hand: two `torchrun --nnodes=2 --node_rank=i --master_addr=127.0.0.1 --master_port=P` processes
started together and waited for.  Runs are paired (baseline and broker back to back, the order swapped every pair)
and the median of the per-pair ratios is the result: on a shared, loaded machine the medians of each side alone
flipped between 0.73 and 1.37, a pair sees the same load on both sides.  Goal: at most 1.03x, the median
of the paired ratios, printed with its 95 % interval (pairs on an idle machine still spread by +-15 %).

    python bench/launch_overhead.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from broker.run.launch import free_port, torchrun_argv  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


#: CPU seconds (user + system) of each side's last run, its whole process tree (the processes it waited for)
CPU: dict[str, float] = {}


def bare(recipe, env, node_envs) -> float:
    c0 = _children_cpu()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        procs = [subprocess.Popen(torchrun_argv(str(recipe.script), recipe.args, nnodes=2, nproc_per_node=1,
                                                node_rank=i, master_addr="127.0.0.1", master_port=port),
                                  cwd=d, env={**env, **node_envs[i]}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
                 for i in range(2)]
        codes = [p.wait(timeout=300) for p in procs]
        dt = time.perf_counter() - t0
    CPU["bare"] = _children_cpu() - c0
    if codes != [0, 0]:
        raise SystemExit(f"bare run failed: {codes}")
    return dt


def broker(env) -> float:
    c0 = _children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "broker", "run", "recipes/ddp_2node.yaml", "--quiet"], cwd=REPO, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    dt = time.perf_counter() - t0
    CPU["broker"] = _children_cpu() - c0
    if p.returncode != 0:
        raise SystemExit(f"broker run failed ({p.returncode}): {p.stderr[-2000:]}")
    return dt


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``xs``: the order statistics k and n-k+1 with k the largest
    count that a fair coin falls below with probability at most (1 - level) / 2 (the sign test's interval); with
    fewer than 6 values it is the whole range."""
    from math import comb

    ys, n = sorted(xs), len(xs)
    k, below = 0, 0.0
    while k < n // 2:
        nxt = below + comb(n, k) / 2 ** n
        if nxt > (1 - level) / 2:
            break
        below, k = nxt, k + 1
    return (ys[k - 1], ys[n - k]) if k > 0 else (ys[0], ys[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    recipe = load_recipe(REPO / "recipes" / "ddp_2node.yaml")
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, **recipe.env, "BROKER_HOME": home, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        # the same devices for both: what the local provider gives each node (one GPU each, or none: gloo on CPU)
        from broker.providers.local import LocalProvider

        local, req = LocalProvider(), recipe.requirements()
        node_envs = [local.node_env(req, i) for i in range(2)]
        print(f"devices per node: {node_envs}")
        # an installed broker has its bytecode compiled at install time; an editable checkout run with
        # PYTHONDONTWRITEBYTECODE=1 would recompile its sources on every start: compile them once, as pip does
        import compileall

        for d in ("broker", "providers"):
            compileall.compile_dir(str(REPO / d), quiet=1)
        bare(recipe, env, node_envs)  # warm the page cache
        broker(env)  # and the first run's lint cache (every later run of an unchanged script reads it)
        b, k, ratios, cpu_ratios, cpu_extra = [], [], [], [], []
        for i in range(a.runs):
            # a pair: both sides back to back, the order swapped every round so neither always runs first
            # (a load spike hits the pair, and the ratio within it, not one side's median)
            if i % 2 == 0:
                bt = bare(recipe, env, node_envs)
                kt = broker(env)
            else:
                kt = broker(env)
                bt = bare(recipe, env, node_envs)
            b.append(bt)
            k.append(kt)
            ratios.append(kt / bt)
            cpu_ratios.append(CPU["broker"] / CPU["bare"])
            cpu_extra.append(CPU["broker"] - CPU["bare"])
    mb, mk, mr = statistics.median(b), statistics.median(k), statistics.median(ratios)
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print(f"bare two-torchrun launch: median {mb:.2f} s  runs {[round(x, 2) for x in b]}")
    print(f"broker run              : median {mk:.2f} s  runs {[round(x, 2) for x in k]}")
    print(f"paired ratios           : {[round(x, 3) for x in ratios]}")
    lo, hi = median_interval(ratios)
    print(f"ratio broker / bare     : {mr:.3f} (median of the {len(ratios)} paired ratios, 95 % interval "
          f"[{lo:.3f}, {hi:.3f}]; overhead {100 * (mr - 1):+.1f} %, goal <= 1.03x: {'met' if mr <= 1.03 else 'NOT met'}"
          f"; ratio of the medians {mk / mb:.3f})")
    print(f"CPU, whole process trees  : broker / bare median {statistics.median(cpu_ratios):.3f} (pairs "
          f"{' '.join(f'{x:.3f}' for x in cpu_ratios)}); broker's extra CPU median "
          f"{statistics.median(cpu_extra):.2f} s (its CLI, the rank shim; a watchdog it starts runs detached and "
          "is not counted)")

if __name__ == "__main__":
    main()
