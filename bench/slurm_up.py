"""Time from `broker slurm up --provider netns --nodes 2` to idle nodes, against a bare baseline.

broker: acquire two netns nodes through the pipeline's NetnsTarget (ledger rows, namespaces, sshd), then over SSH
read the node facts, write the MUNGE key and slurm.conf, start munged/slurmctld/slurmd and poll `sinfo` on node 0
until both nodes are idle (:func:`broker.slurm.cluster.up`).  Then `slurm down` is timed too.

Baseline: the test fixture that builds the same Slurm cluster directly on this machine with no SSH and no ledger
(tests/support/slurm_cluster.py: namespaces, munged, slurmctld in the root namespace, slurmd per node), from nothing to
`sinfo` showing 2 idle nodes.  Rounds alternate (baseline, broker, ...) so load drift hits both; medians compared.

    python bench/slurm_up.py [--runs 3]      # root, slurm-wlm, munge, openssh-server
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def baseline() -> float:
    from tests.support.slurm_cluster import SlurmCluster, new_root

    root = new_root()
    c = SlurmCluster(root)
    try:
        t0 = time.perf_counter()
        c.start()
        return time.perf_counter() - t0
    finally:
        left = c.stop()
        shutil.rmtree(root, ignore_errors=True)
        if left:
            print(f"baseline left: {left}", file=sys.stderr)


def broker_round() -> tuple[float, float]:
    home = Path(tempfile.mkdtemp(prefix="broker-bench-slurmup-"))
    os.environ["BROKER_HOME"] = str(home)
    os.environ["BROKER_WATCHDOG_AUTOSTART"] = "0"
    from broker.core.config import settings
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import UpOptions, down, up

    settings.cache_clear()
    led = Ledger()
    try:
        t0 = time.perf_counter()
        state = up(UpOptions(provider="netns", nodes=2), ledger=led)
        t_up = time.perf_counter() - t0
        t0 = time.perf_counter()
        left = down(led, state.cluster_id)
        t_down = time.perf_counter() - t0
        if left:
            print(f"broker left: {left}", file=sys.stderr)
        return t_up, t_down
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from tests.support.slurm_cluster import why_not_available

    from broker.providers.netns import missing_requirements

    why = why_not_available() or missing_requirements()
    if why:
        sys.exit(f"cannot run here: {why}")
    base, ups, downs = [], [], []
    for i in range(args.runs):
        base.append(baseline())
        u, d = broker_round()
        ups.append(u)
        downs.append(d)
        print(f"round {i + 1}: baseline {base[-1]:.2f} s; broker slurm up {u:.2f} s, slurm down {d:.2f} s",
              flush=True)
    mb, mu, md = statistics.median(base), statistics.median(ups), statistics.median(downs)
    print(f"median: bare fixture to idle {mb:.2f} s; `broker slurm up` to idle {mu:.2f} s (x{mu / mb:.1f}); "
          f"`broker slurm down` {md:.2f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s)")


if __name__ == "__main__":
    main()
