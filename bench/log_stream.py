"""Log streaming: a rank that prints ``--lines`` lines (200,000 by default) through ``broker run``, against the same
script piped through ``| cat``, measured in the same run.

Four commands per round, alternated so load drifts hit every side (their order rotates each round):

* ``cat``      -- the bare baseline: ``python spam.py | cat > /dev/null`` (what the rank's print loop costs when
  its reader is as fast as ``cat``);
* ``streamed`` -- ``broker run spam.yaml --provider local | cat > /dev/null``: every line shown as ``[node 0] ...``;
* ``quiet``    -- the same with ``-q`` (nothing shown; the node log is still written);
* ``empty``    -- ``broker run`` of the same script printing no line: broker's fixed cost (start-up, torchrun,
  the summary), subtracted to get broker's own CPU per line.

Measured per run: wall time; the rank's own print loop (the script times it and prints ``LOOP_S=..``: how much the
node was slowed by its reader; for the broker runs it is read from the node log); broker's own CPU (user + system
of the broker process alone, its children excluded: ``getrusage(RUSAGE_SELF)`` written at exit by a wrapper).
Also the CPU of the whole run (the broker process, torchrun, the rank and ``cat``: ``RUSAGE_CHILDREN``), the
load-independent side of "streamed vs quiet".  Printed: the median over rounds of each round's ratios (paired,
never a ratio of medians), the per-line CPU, and the load average beside them.  Goals: ``streamed/quiet`` wall <= 1.1, broker CPU <= 2 us per line, the node's loop
under broker within 1.1x of ``| cat``'s.

    .venv/bin/python bench/log_stream.py [--rounds 5] [--lines 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SPAM = """\
import os, sys, time
n = int(os.environ.get("SPAM_LINES", "200000"))
t0 = time.perf_counter()
for i in range(n):
    if i % 1000 == 0:  # a title-set (OSC) and an erase-line (CSI) now and then: stripped on the way to the terminal
        print(f"\\x1b]0;step {i}\\x07\\x1b[2Kprogress {i}", flush=True)
    print(f"step {i} loss=0.{i % 997:03d} lr=3e-4 tokens/s=12345.6 \\u00e9poch", flush=True)
print(f"LOOP_S={time.perf_counter() - t0:.4f}", flush=True)
"""

RECIPE = "name: spam\nscript: spam.py\nnodes: 1\ngpus_per_node: 1\ncpu_ok: true\nmax_hours: 0.2\n"

#: runs broker's CLI in this process and writes this process's own CPU (children excluded) at exit
WRAP = ("import atexit, json, resource, sys\n"
        "out = sys.argv.pop(1)\n"
        "def _w():\n"
        "    r = resource.getrusage(resource.RUSAGE_SELF)\n"
        "    open(out, 'w').write(json.dumps({'cpu_s': r.ru_utime + r.ru_stime}))\n"
        "atexit.register(_w)\n"
        "from broker.cli.app import main\n"
        "sys.argv[0] = 'broker'\n"
        "main()\n")


def _env(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_", "BROKER_"))}
    env.update(BROKER_HOME=home, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", COLUMNS="100")
    return env


def _loop_s(text: str) -> float | None:
    for line in reversed(text.splitlines()):
        if line.startswith("LOOP_S="):
            return float(line.split("=", 1)[1])
    return None


def _piped(argv: list[str], cwd: Path, env: dict[str, str], out: Path) -> tuple[float, int, str]:
    """Run ``argv | cat > out``; (wall seconds, argv's exit code, its stderr tail).  The CPU seconds of the whole
    tree (argv, everything it started, and cat) go to :data:`LAST_TREE_CPU`."""
    import resource

    global LAST_TREE_CPU
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(out, "wb") as f:
        p1 = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p2 = subprocess.Popen(["cat"], stdin=p1.stdout, stdout=f)
        assert p1.stdout is not None
        p1.stdout.close()  # cat holds the pipe's read end alone
        err = p1.stderr.read() if p1.stderr else b""
        rc = p1.wait()
        p2.wait()
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_TREE_CPU = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, rc, err.decode(errors="replace")[-2000:]


LAST_TREE_CPU = 0.0


def run_cat(job: Path, env: dict[str, str], lines: int) -> dict:
    out = job.parent / "cat_out.txt"
    wall, rc, err = _piped([sys.executable, "spam.py"], job, {**env, "SPAM_LINES": str(lines)}, out)
    if rc != 0:
        raise SystemExit(f"baseline failed ({rc}): {err}")
    return {"wall_s": wall, "loop_s": _loop_s(out.read_text(errors="replace"))}


def run_broker(job: Path, env: dict[str, str], home: str, lines: int, quiet: bool) -> dict:
    cpu_file, shown = job.parent / "cpu.json", job.parent / "shown.txt"
    argv = [sys.executable, str(job.parent / "wrap.py"), str(cpu_file), "run", str(job / "spam.yaml"), "--provider",
            "local", *(["-q"] if quiet else [])]
    wall, rc, err = _piped(argv, job, {**env, "SPAM_LINES": str(lines)}, shown)
    if rc != 0:
        raise SystemExit(f"broker run failed ({rc}): {err}")
    runs = sorted((Path(home) / "runs").iterdir(), key=lambda d: d.stat().st_mtime)
    log = (runs[-1] / "node0.log").read_text(errors="replace")
    text = shown.read_text(errors="replace")
    return {"wall_s": wall, "cpu_s": json.loads(cpu_file.read_text())["cpu_s"], "loop_s": _loop_s(log),
            "tree_cpu_s": LAST_TREE_CPU,
            "esc_shown": "\x1b" in text, "esc_logged": "\x1b" in log,
            "lines_shown": text.count("[node 0] step ")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lines", type=int, default=200_000)
    a = ap.parse_args()
    n = a.lines
    with tempfile.TemporaryDirectory() as tmp:
        job, home = Path(tmp) / "job", str(Path(tmp) / "home")
        job.mkdir()
        (job / "spam.py").write_text(SPAM)
        (job / "spam.yaml").write_text(RECIPE)
        (job.parent / "wrap.py").write_text(WRAP)
        env = _env(home)
        import compileall

        for d in ("broker", "providers"):
            compileall.compile_dir(str(ROOT / d), quiet=1)
        load0 = os.getloadavg()
        run_broker(job, env, home, 1000, quiet=False)  # warm the page cache and the lint cache
        sides = {
            "cat": lambda: run_cat(job, env, n),
            "streamed": lambda: run_broker(job, env, home, n, quiet=False),
            "quiet": lambda: run_broker(job, env, home, n, quiet=True),
            "empty": lambda: run_broker(job, env, home, 0, quiet=False),
        }
        order = list(sides)
        rounds: list[dict] = []
        for r in range(a.rounds):
            k = r % len(order)
            res = {name: sides[name]() for name in order[k:] + order[:k]}
            rounds.append(res)
            s, q, c, e = res["streamed"], res["quiet"], res["cat"], res["empty"]
            print(f"round {r + 1}: cat wall {c['wall_s']:.2f}s loop {c['loop_s']:.2f}s | streamed wall "
                  f"{s['wall_s']:.2f}s loop {s['loop_s']:.2f}s cpu {s['cpu_s']:.2f}s | quiet wall {q['wall_s']:.2f}s "
                  f"loop {q['loop_s']:.2f}s cpu {q['cpu_s']:.2f}s | empty wall {e['wall_s']:.2f}s cpu "
                  f"{e['cpu_s']:.2f}s | run CPU streamed {s['tree_cpu_s']:.2f}s quiet {q['tree_cpu_s']:.2f}s | load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
        load1 = os.getloadavg()

    def med(f) -> float:
        return statistics.median(f(x) for x in rounds)

    wall_sq = med(lambda x: x["streamed"]["wall_s"] / x["quiet"]["wall_s"])
    cpu_sq = med(lambda x: x["streamed"]["tree_cpu_s"] / x["quiet"]["tree_cpu_s"])
    loop_sc = med(lambda x: x["streamed"]["loop_s"] / x["cat"]["loop_s"])
    loop_qc = med(lambda x: x["quiet"]["loop_s"] / x["cat"]["loop_s"])
    loop_sq = med(lambda x: x["streamed"]["loop_s"] / x["quiet"]["loop_s"])
    wall_sc = med(lambda x: (x["streamed"]["wall_s"] - x["empty"]["wall_s"]) / x["cat"]["wall_s"])
    us_line = med(lambda x: (x["streamed"]["cpu_s"] - x["empty"]["cpu_s"]) / n * 1e6)
    us_quiet = med(lambda x: (x["quiet"]["cpu_s"] - x["empty"]["cpu_s"]) / n * 1e6)
    last = rounds[-1]["streamed"]
    print(f"lines per run: {n}; rounds: {a.rounds}; load average before {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}, after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (2 cores shared)")
    print(f"streamed / quiet wall time          : {wall_sq:.3f}  (goal <= 1.1; on a loaded machine the CPU ratio "
          "below is the steadier one)")
    print(f"streamed / quiet CPU of the whole run: {cpu_sq:.3f}  (broker + torchrun + the rank + cat; goal <= 1.1)")
    print(f"node print loop, streamed / | cat   : {loop_sc:.3f}  (the node never waits on broker: goal <= 1.1)")
    print(f"node print loop, quiet / | cat      : {loop_qc:.3f}  (under torchrun, beside broker's reader)")
    print(f"node print loop, streamed / quiet   : {loop_sq:.3f}  (what showing the lines costs the node)")
    print(f"(streamed - empty run) / | cat wall : {wall_sc:.3f}")
    print(f"broker CPU per line, streamed       : {us_line:.2f} us  (goal <= 2 us; broker's own process, minus "
          "the empty run)")
    print(f"broker CPU per line, quiet          : {us_quiet:.2f} us")
    print(f"shown lines {last['lines_shown']} of {n}; ESC on the terminal side: {last['esc_shown']}; ESC kept in "
          f"the node log: {last['esc_logged']}")


if __name__ == "__main__":
    main()
