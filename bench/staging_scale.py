"""Staging mechanics against the plain tools, in the same run.

* local: copying a work folder of ``--files`` small files into a node folder (``broker.run.staging.copy_staged``)
  against ``cp -a`` of the same folder;
* SSH / Slurm: one ``--gib`` GiB file of random bytes packed for upload (``broker.run.staging.staged_tar``: a tar file
  on disk, compressed only when worth it) against ``tar -cf - | cat > /dev/null``;
  with ``--old`` also the former in-memory ``tar.gz`` (``tarfile`` ``w:gz``) for the record.

Each side runs in its own subprocess (CPU = user + system, peak RSS from getrusage), the two sides of a pair back to
back with the order swapped every pair; the median of the per-pair ratios is printed with the load average.
Goals: local 20,000 files <= 2 s; the upload's memory flat (peak RSS about the bare interpreter's).

``--fs xfs|btrfs|ext4|ext4-nojournal`` runs both sides on a fresh filesystem of that kind in a loop-mounted image
(tests/support/loopfs.py; needs root): on XFS (reflink=1) and btrfs broker's copy is a reflink per file.

Without ``--keep`` each side first deletes the copy it made before (``rm -rf``, as ``broker clean`` does): on ext4
without a journal (this dev VM's root filesystem, and ``--fs ext4-nojournal``) the kernel then skips every inode
freed in the last minutes for each new file (``fs/ext4/ialloc.c``, ``recently_deleted``), and both sides slow down
alike; ``--keep`` copies into new folders and deletes nothing until the end.

    python bench/staging_scale.py [--files 20000] [--gib 1] [--pairs 3] [--keep] [--old] [--fs xfs]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
what, src, dst = sys.argv[2:5]
from pathlib import Path
from broker.run.staging import copy_staged, stage_plan, staged_tar
plan = stage_plan(Path(src))
r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
extra = {}
if what == "copy":
    extra = copy_staged(plan, Path(dst))
elif what == "tar":
    with staged_tar(plan, Path(dst)) as tar:
        extra = {"compressed": tar.compressed, "bytes": tar.path.stat().st_size}
elif what == "old-tgz":
    import io, tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", dereference=True) as tf:
        for rel in plan.files:
            tf.add(str(plan.source(rel)), arcname=rel.as_posix(), recursive=False)
    extra = {"bytes": len(buf.getvalue())}
wall = time.perf_counter() - t; r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": wall, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                  "rss_mib": r1.ru_maxrss / 1024, **extra}))
"""


def broker_side(what: str, src: Path, dst: Path) -> dict:
    """One broker staging step in a subprocess (the stage plan walk is excluded from the timing)."""
    if dst.exists() and what == "copy":
        shutil.rmtree(dst)
    p = subprocess.run([sys.executable, "-c", CHILD, str(REPO), what, str(src), str(dst)], capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def tool_side(argv: str) -> dict:
    """A plain shell pipeline: wall, and CPU of its children."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(["sh", "-c", argv], check=True)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}


def pairs(n: int, ours, theirs) -> tuple[list[dict], list[dict]]:
    a, b = [], []
    for i in range(n):
        if i % 2 == 0:
            a.append(ours())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(ours())
    return a, b


def report(label: str, a: list[dict], b: list[dict], base: str) -> None:
    wr = statistics.median(x["wall"] / y["wall"] for x, y in zip(a, b))
    aw, bw = statistics.median(x["wall"] for x in a), statistics.median(y["wall"] for y in b)
    ac = statistics.median(x["cpu"] for x in a)
    print(f"{label}: broker wall {aw:.2f} s (CPU {ac:.2f} s, peak RSS {max(x['rss_mib'] for x in a):.0f} MiB) vs "
          f"{base} wall {bw:.2f} s; ratio {wr:.2f}x (median of {len(a)} paired ratios)"
          f"  [{', '.join(f'{k}={v}' for k, v in a[-1].items() if k not in ('wall', 'cpu', 'rss_mib'))}]")
    print("  pairs (broker / base wall s, in run order): "
          + ", ".join(f"{x['wall']:.2f}/{y['wall']:.2f}" for x, y in zip(a, b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--keep", action="store_true",
                    help="copy each time into a new folder and remove none until the end: on ext4 without a "
                         "journal, files created in the minutes after many were deleted are slow to create (the "
                         "kernel does not reuse recently freed inodes), for both sides alike")
    ap.add_argument("--old", action="store_true", help="also the former in-memory tar.gz (slow: ~20 s CPU per GiB)")
    ap.add_argument("--fs", choices=["xfs", "btrfs", "ext4", "ext4-nojournal"],
                    help="run on a fresh filesystem of this kind (a loop-mounted image; root)")
    a = ap.parse_args()
    with contextlib.ExitStack() as stack:
        where = os.environ.get("BENCH_TMP")
        if a.fs:
            sys.path.insert(0, str(REPO))
            from tests.support.loopfs import loop_fs

            where = str(stack.enter_context(loop_fs(a.fs, size_mib=int(a.gib * 1024) * 3 + 4096)))
        print(f"filesystem: {_fs(where or tempfile.gettempdir())}{' (loop image)' if a.fs else ''}"
              f"{'' if a.keep else '; each side first deletes its previous copy'}")
        run(a, where)


def _fs(path: str) -> str:
    sys.path.insert(0, str(REPO))
    from broker.run.staging import ext4_without_journal, fs_type

    return (fs_type(path) or "unknown") + (" without a journal" if ext4_without_journal(path) else "")


def run(a: argparse.Namespace, where: str | None) -> None:
    la0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=where) as d:
        d = Path(d)
        small = d / "small"
        for i in range(a.files):
            sub = small / f"pkg{i // 500}" / f"m{(i // 50) % 10}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"f{i}.py").write_text(f"x = {i}\n" * 40)
        big = d / "big"
        big.mkdir()
        with open(big / "data.bin", "wb") as f:
            for _ in range(int(a.gib * 1024)):
                f.write(os.urandom(1 << 20))
        subprocess.run(["sh", "-c", f"cat {big}/data.bin > /dev/null"], check=True)  # page cache warm for both
        # written back before either side runs, as a user's work folder normally is: a reflink (FICLONE) first
        # flushes its source's dirty pages, so the first clone of a just-written tree would pay the tree's writeback
        os.sync()
        if a.keep:  # every copy into a folder of its own, none removed before the end (see --keep)
            n = iter(range(10**6))
            local = pairs(a.pairs, lambda: broker_side("copy", small, d / f"node{next(n)}"),
                          lambda: tool_side(f"cp -a {small} {d}/cp{next(n)}"))
        else:
            local = pairs(a.pairs, lambda: broker_side("copy", small, d / "node"),
                          lambda: tool_side(f"rm -rf {d}/cp && cp -a {small} {d}/cp"))
        up = pairs(a.pairs, lambda: broker_side("tar", big, d / "run"),
                   lambda: tool_side(f"tar -cf - -C {big} . | cat > /dev/null"))
        old = broker_side("old-tgz", big, d / "run") if a.old else None
    la1 = os.getloadavg()
    print(f"load average {la0[0]:.2f} -> {la1[0]:.2f} (1 min), {la1[1]:.2f} (5 min); {os.cpu_count()} cores")
    report(f"local copy, {a.files} files", *local, "cp -a")
    report(f"upload tar, {a.gib:g} GiB random file", *up, "tar | cat > /dev/null")
    print(f"bare interpreter peak RSS: {_bare_rss():.0f} MiB")
    if old:
        print(f"former in-memory tar.gz of the same file: wall {old['wall']:.2f} s, CPU {old['cpu']:.2f} s, peak RSS "
              f"{old['rss_mib']:.0f} MiB")
    lw = statistics.median(x["wall"] for x in local[0])
    print(f"goal local copy <= 2 s: {'met' if lw <= 2 else 'NOT met'} (wall {lw:.2f} s)")


def _bare_rss() -> float:
    code = "import resource, sys; sys.path.insert(0, sys.argv[1]); import broker.run.staging; " \
           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return float(subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True,
                                check=True).stdout)


if __name__ == "__main__":
    main()
