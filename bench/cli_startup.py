"""CLI start-up time as a ratio to a bare interpreter (``python -c pass``), measured in the same run.

Times, once as usual and once with PYTHONDONTWRITEBYTECODE=1 (Docker and CI images: only the bytecode the install
compiled is read), ``broker --help``, ``broker status`` (an empty home) and ``broker plan --budget 5`` (offline: a temporary
BROKER_HOME, no credentials, no network), each run ``--starts`` times interleaved with the baseline's (one round:
the baseline, then each command, the order reversed every other round), and prints the median of the per-round
ratios (each command's run over the baseline's run of the same round: paired, so a load change between rounds
cancels out) against the goals (``--help`` <= 5x, ``status`` <= 4x, ``plan`` <= 4x).  Both wall time and CPU time (user + system of the child, from
``getrusage``) are shown; on a shared, loaded machine the CPU ratio is the fair one (the goals are checked on it).  ``--imports`` adds the slowest imports of each command
(``python -X importtime``), to see where the time goes.

Each command is run once first and must exit 0: a broker that cannot run at all (a python without broker
installed) fails loudly (exit 2, the command's stderr tail) instead of timing failures.

Run with the venv's python (the one broker is installed in): ``.venv/bin/python bench/cli_startup.py [--starts 15]
[--imports]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"broker --help": 5.0, "broker status": 4.0, "broker plan --budget 5": 4.0}


def _env(home: str, no_bytecode_writes: bool = False) -> dict[str, str]:
    """The commands' environment: no credentials, a temporary home; ``no_bytecode_writes`` sets
    PYTHONDONTWRITEBYTECODE=1 (as Dockerfiles and CI images do), so only the bytecode the install left is used."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VAST_", "OCI_", "BROKER_"))}
    env.update(BROKER_HOME=home, HOME=home, PYTHONPATH=str(ROOT), AWS_EC2_METADATA_DISABLED="true",
               OCI_CONFIG_FILE=f"{home}/no-oci", AWS_CONFIG_FILE=f"{home}/no-aws",
               AWS_SHARED_CREDENTIALS_FILE=f"{home}/no-aws-creds", XDG_CONFIG_HOME=f"{home}/xdg",
               COLUMNS="100", PYTHONDONTWRITEBYTECODE="1" if no_bytecode_writes else "")
    return env


def _broker() -> list[str]:
    """The installed console script when there is one beside this interpreter (what users run), else -m broker."""
    script = Path(sys.executable).parent / "broker"
    return [str(script)] if script.exists() else [sys.executable, "-m", "broker"]


def _time(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``argv``."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


class BrokerDoesNotRun(RuntimeError):
    """A timed command did not exit 0 (its message holds the command, the exit status and its stderr tail)."""


def check_runs(argv: list[str], env: dict[str, str], cwd: str) -> None:
    """Run ``argv`` once; raise :class:`BrokerDoesNotRun` unless it exits 0 (timing a failing command would
    measure nothing)."""
    cp = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                        check=False)
    if cp.returncode != 0:
        tail = "\n".join(cp.stderr.strip().splitlines()[-15:]) or "(no stderr)"
        raise BrokerDoesNotRun(f"`{' '.join(argv)}` exited {cp.returncode}; its stderr ends:\n{tail}\n"
                               f"run this benchmark with the python broker is installed in (the venv's: "
                               f".venv/bin/python bench/cli_startup.py)")


def measure(starts: int, no_bytecode_writes: bool = False) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each round's run of the baseline and of each command (runs interleaved, the order
    reversed every other round, after one warm-up each): ``times[k][i]`` is round ``i``'s run of ``k``."""
    home = tempfile.mkdtemp(prefix="broker-bench-")
    try:
        env = _env(home, no_bytecode_writes)
        cmds = {"python -c pass": [sys.executable, "-c", "pass"],
                "broker --help": _broker() + ["--help"],
                "broker status": _broker() + ["status"],  # an empty home: no runs yet
                "broker plan --budget 5": _broker() + ["plan", "--budget", "5"]}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
        for argv in cmds.values():  # must run at all; warms caches (and writes .pyc files)
            check_runs(argv, env, home)
        for i in range(starts):
            for k, argv in (list(cmds.items()) if i % 2 == 0 else list(cmds.items())[::-1]):
                times[k].append(_time(argv, env, home))
        return times
    finally:
        shutil.rmtree(home, ignore_errors=True)


def slowest_imports(argv: list[str], n: int = 12) -> list[tuple[int, str]]:
    """The ``n`` imports with the largest cumulative time (microseconds) for ``argv`` (``-X importtime``)."""
    home = tempfile.mkdtemp(prefix="broker-bench-")
    try:
        cp = subprocess.run([sys.executable, "-X", "importtime", "-m", "broker", *argv], env=_env(home), cwd=home,
                            capture_output=True, text=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    rows = []
    for line in cp.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cum, name = (x.strip() for x in line[len("import time:"):].split("|"))
            rows.append((int(cum), name))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=15, help="runs per command (median)")
    ap.add_argument("--imports", action="store_true", help="also list the slowest imports of each command")
    a = ap.parse_args()
    ok = True
    # both ways users start it: bytecode written on first start (the default), and PYTHONDONTWRITEBYTECODE=1
    # (Docker and CI images), where only what the install compiled is there to read
    for no_writes in (False, True):
        print(f"--- PYTHONDONTWRITEBYTECODE={'1' if no_writes else '(unset)'}")
        ok &= _report(a.starts, no_writes)
    if a.imports:
        for label, argv in (("--help", ["--help"]), ("status", ["status"]),
                            ("plan --budget 5", ["plan", "--budget", "5"])):
            print(f"slowest imports of broker {label} (cumulative ms):")
            for us, name in slowest_imports(argv):
                print(f"  {us / 1000:7.1f}  {name}")
    sys.exit(0 if ok else 1)


def _report(starts: int, no_bytecode_writes: bool) -> bool:
    """Measure and print one environment's rows; True when every goal is met."""
    try:
        load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        times = measure(starts, no_bytecode_writes)
    except BrokerDoesNotRun as e:
        print(f"cli_startup: broker does not run, nothing measured: {e}", file=sys.stderr)
        sys.exit(2)
    base = times["python -c pass"]
    bw, bc = statistics.median(w for w, _ in base), statistics.median(c for _, c in base)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"python -c pass: wall {bw * 1000:.1f} ms, CPU {bc * 1000:.1f} ms (median of {starts}; {os.cpu_count()} "
          f"cores, load average {load0:.1f} -> {load:.1f})")
    ok = True
    for k, goal in GOALS.items():
        runs = times[k]
        w, c = statistics.median(x for x, _ in runs), statistics.median(y for _, y in runs)
        wall_ratio = statistics.median(x / b for (x, _), (b, _) in zip(runs, base))
        ratio = statistics.median(y / b for (_, y), (_, b) in zip(runs, base))
        ok &= ratio <= goal
        print(f"{k}: wall {w * 1000:.1f} ms, {wall_ratio:.1f}x; CPU {c * 1000:.1f} ms, {ratio:.1f}x python -c pass "
              f"(median of {len(runs)} paired ratios; goal <= {goal:g}x on CPU: {'met' if ratio <= goal else 'missed'})")
    return ok


if __name__ == "__main__":
    main()
