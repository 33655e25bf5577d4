"""Preemption to "the job runs again": how long after the provider takes a node back the resumed job makes its
first step on the new node, as a ratio to a cold start measured in the same run (run start to the first step of
attempt 1: acquire, stage, launch).  The difference is detection (the node watch's describe interval), teardown
confirmed, renting again and restoring the checkpoint.

Through the real pipeline (:func:`broker.run.pipeline.run_pipeline`, a CloudTarget) on the fake cloud (instances
are local processes; the "provider" terminates the instance once the job has made some steps).

    python bench/preempt_resume.py [--runs 3] [--monitor 1.0] [--out bench/results/preempt_resume_dev2core.txt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

JOB = """
import json, os, pathlib, time
ck = pathlib.Path("ckpt"); ck.mkdir(exist_ok=True)
state = ck / "state.json"
start = json.loads(state.read_text())["step"] if state.exists() else 0
for step in range(start, 40):
    time.sleep(0.2)
    tmp = ck / "state.json.tmp"; tmp.write_text(json.dumps({"step": step + 1})); os.replace(tmp, state)
    with open(%r, "a") as f:
        f.write(f"{time.time()} {start} {step + 1}\\n")
"""


def one(monitor_s: float) -> tuple[float, float, int]:
    """(cold start s, preemption-to-running-again s, resumed step) of one run."""
    from broker.core.recipe import load_recipe
    from broker.money.ledger import Ledger
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        os.environ["BROKER_HOME"] = str(d / "home")
        os.environ["BROKER_FAKE_STATE"] = str(d / "fake.json")
        os.environ["BROKER_WATCHDOG_AUTOSTART"] = "0"
        steps = d / "steps"
        (d / "r").mkdir()
        (d / "r" / "job.py").write_text(JOB % str(steps))
        (d / "r" / "r.yaml").write_text("name: preempt-bench\nscript: job.py\nnodes: 1\ncpu_ok: true\n"
                                        "topology: simulated\nbudget_usd: 50\nmax_hours: 1\ninterruptible: true\n"
                                        "checkpoint_dir: ckpt\ncheckpoint_every_s: 1\n")
        recipe = load_recipe(d / "r" / "r.yaml")
        p = FakeProvider()
        opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
        t: dict[str, float] = {}

        def lines() -> list[list[str]]:
            try:
                return [ln.split() for ln in steps.read_text().splitlines() if ln.strip()]
            except OSError:
                return []

        def preempt() -> None:
            while True:
                ls = lines()
                if len(ls) >= 12:  # a checkpoint has been copied back (every 1 s) by now
                    (iid,) = [i for i, x in p.instances().items() if x["state"] == "running"]
                    t["preempt"] = time.time()
                    p.destroy(iid)
                    return
                time.sleep(0.01)

        th = threading.Thread(target=preempt, daemon=True)
        th.start()
        t["start"] = time.time()
        out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1,
                                               monitor_s=monitor_s), ledger=Ledger(), hooks=Hooks())
        assert out.exit_code == 0, out.result.reason
        ls = lines()
        first = float(ls[0][0])
        again = [ln for ln in ls if float(ln[0]) > t["preempt"] and int(ln[1]) > 0]
        return first - t["start"], float(again[0][0]) - t["preempt"], int(again[0][1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--monitor", type=float, default=1.0, help="seconds between the node watch's describes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    load_before = os.getloadavg()
    for i in range(args.runs):
        cold, again, step = one(args.monitor)
        rows.append((cold, again, step))
        print(f"run {i + 1}: cold start {cold:.2f} s; preemption -> running again {again:.2f} s "
              f"(ratio {again / cold:.2f}); resumed at step {step}", flush=True)
    cold = statistics.median(r[0] for r in rows)
    again = statistics.median(r[1] for r in rows)
    text = [f"# bench/preempt_resume.py --runs {args.runs} --monitor {args.monitor:g} (fake cloud, 1 node)",
            f"# load average (1/5/15 min) before {load_before}, after {os.getloadavg()} (2 shared cores)", *[f"cold={c:.3f}s again={a:.3f}s step={s}"
                                                             for c, a, s in rows],
            f"median cold start {cold:.2f} s; median preemption -> running again {again:.2f} s; "
            f"ratio {again / cold:.2f} (detection interval {args.monitor:g} s included)"]
    print(text[-1])
    if args.out:
        args.out.write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
