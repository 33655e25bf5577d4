"""All-reduce bandwidth over the emulated hybrid tunnel against the direct netns path, as a ratio.

Runs ``recipes/allreduce_bench.yaml`` twice through ``broker run`` (root, Linux): ``--provider netns`` (two
namespaces on one bridge: the direct path) and ``--provider netns --topology hybrid`` (two sites behind two NATs,
the job inside a per-run WireGuard tunnel), reads rank 0's ``BENCH size_mib=.. busbw_gbps=..`` lines and prints,
per message size, both bus bandwidths (MB/s, from the measured time) and ``tunnel/direct``.  On CPU (gloo) both use TCP sockets; with GPUs the
direct run gives NCCL one GPU per node (NET/Socket) while the emulated hybrid runs gloo on CPU, so compare CPU
runs (``--cpu``, the default where the GPUs are not split) for a like-for-like ratio.

    sudo python bench/hybrid_bandwidth.py [--sizes 1,4,16] [--iters 5]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"BENCH size_mib=([\d.]+) time_ms=([\d.]+) algbw_gbps=([\d.]+) busbw_gbps=([\d.]+)")


def recipe_for(folder: Path, sizes: str, iters: int, cpu: bool) -> Path:
    """recipes/allreduce_bench.yaml with the sizes and iterations in its env (the env of `broker run` itself does
    not reach the nodes)."""
    import yaml

    src = REPO / "recipes" / "allreduce_bench.yaml"
    d = yaml.safe_load(src.read_text())
    d["script"] = str(REPO / "recipes" / d["script"])
    d["workdir"] = str(REPO / "recipes")
    d["env"] = {**d.get("env", {}), "BENCH_SIZES_MIB": sizes, "BENCH_ITERS": str(iters)}
    if cpu:
        d["env"]["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU on the nodes too
    out = folder / "allreduce_bench.yaml"
    out.write_text(yaml.safe_dump(d))
    return out


def run(extra: list[str], home: Path, sizes: str, iters: int, cpu: bool) -> dict[float, float]:
    env = dict(os.environ, BROKER_HOME=str(home), PYTHONWARNINGS="ignore")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    home.mkdir(parents=True, exist_ok=True)
    recipe = recipe_for(home, sizes, iters, cpu)
    p = subprocess.run([sys.executable, "-m", "broker", "run", str(recipe), "--provider", "netns", "--quiet",
                        *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    logs = "".join(f.read_text(errors="replace") for f in sorted(home.glob("runs/*/node0.log")))
    if p.returncode != 0:
        raise SystemExit(f"broker run {' '.join(extra) or '(direct)'} failed (exit {p.returncode}):\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    # bus bandwidth from the time (the printed GB/s has two decimals only): 2 nodes -> busbw = algbw
    return {float(m.group(1)): float(m.group(1)) * 2**20 / (float(m.group(2)) / 1e3) / 1e6
            for m in LINE.finditer(logs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16", help="message sizes in MiB (comma list)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu", action="store_true", help="let the direct run use GPUs (NCCL) where present")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        direct = run([], Path(d) / "direct", a.sizes, a.iters, cpu=not a.gpu)
        tunnel = run(["--topology", "hybrid"], Path(d) / "hybrid", a.sizes, a.iters, cpu=True)
    print(f"{'size MiB':>9} {'direct busbw MB/s':>18} {'tunnel busbw MB/s':>18} {'tunnel/direct':>14}")
    for size in sorted(direct):
        dv, tv = direct[size], tunnel.get(size)
        ratio = f"{tv / dv:.3f}" if tv is not None and dv > 0 else "-"
        print(f"{size:>9g} {dv:>18.1f} {tv if tv is not None else float('nan'):>18.1f} {ratio:>14}")
    sizes = [s for s in direct if s in tunnel and direct[s] > 0]
    if sizes:
        big = max(sizes)
        print(f"RATIO tunnel/direct at {big:g} MiB: {tunnel[big] / direct[big]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
