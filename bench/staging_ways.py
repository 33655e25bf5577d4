"""A/B of ways to make a local node's work folder (docs/staging.md), in one process, the ways alternated (the order
reversed every round): ``old`` = copy_staged as of commit ea40d8b (read with ``git show``), ``new`` = the current
copy_staged, ``lean`` = the same loop inline, ``hardlink`` = os.link per file (NOT a safe way: the copy shares the
user's inode; listed for scale).  Prints (wall s, CPU s) per round, the median wall ratio against ``old`` (paired),
and the load average.

    python bench/staging_ways.py TMPDIR [FILES=20000] [ROUNDS=3]
"""
import os, sys, time, shutil, resource, statistics, stat, subprocess, types
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from broker.run.staging import stage_plan, copy_staged
oldstaging = types.ModuleType("oldstaging")
sys.modules["oldstaging"] = oldstaging  # dataclasses look their module up
exec(subprocess.run(["git", "-C", REPO, "show", "ea40d8b:broker/run/staging.py"], capture_output=True, text=True,
                    check=True).stdout, oldstaging.__dict__)
base = Path(sys.argv[1]); N = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
src = base / "small"
if not src.exists():
    for i in range(N):
        sub = src / f"pkg{i // 500}" / f"m{(i // 50) % 10}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.py").write_text(f"x = {i}\n" * 40)
plan = stage_plan(src)
root = str(src)
rels = [r.as_posix() for r in plan.files]

def lean(dst, threads=0):
    os.makedirs(dst, mode=0o700)
    dirs = sorted({r.rpartition("/")[0] for r in rels if "/" in r})
    for d in dirs:
        os.makedirs(os.path.join(dst, d), mode=0o700, exist_ok=True)
    def one(r):
        sfd = os.open(root + "/" + r, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(sfd)
            dfd = os.open(dst + "/" + r, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, st.st_mode & 0o700)
            try:
                left = st.st_size
                while left > 0:
                    n = os.copy_file_range(sfd, dfd, left)
                    if n == 0: break
                    left -= n
                os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
    if threads:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, rels, chunksize=64) if False else ex.map(one, rels))
    else:
        for r in rels: one(r)

def links(dst):
    os.makedirs(dst, mode=0o700)
    for d in sorted({r.rpartition("/")[0] for r in rels if "/" in r}):
        os.makedirs(os.path.join(dst, d), mode=0o700, exist_ok=True)
    for r in rels: os.link(root + "/" + r, dst + "/" + r)

ways = {"old": lambda d: oldstaging.copy_staged(plan, Path(d)), "new": lambda d: copy_staged(plan, Path(d)), "lean": lean, "hardlink": links}
res = {k: [] for k in ways}
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for k, f in (list(ways.items()) if rep % 2 == 0 else list(ways.items())[::-1]):
        d = str(base / f"dst-{k}")
        shutil.rmtree(d, ignore_errors=True)
        os.sync()
        r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
        f(d)
        w = time.perf_counter() - t; r1 = resource.getrusage(resource.RUSAGE_SELF)
        res[k].append((w, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime))
        print(rep, k, res[k][-1], os.getloadavg()[0], flush=True)
print("load", os.getloadavg())
print({k: round(statistics.median(a[0]/b[0] for a, b in zip(v, res["old"])), 2) for k, v in res.items()})
for k, v in res.items():
    print(f"{k:10s} wall {statistics.median(w for w,_ in v):.2f}  cpu {statistics.median(c for _,c in v):.2f}  walls {[round(w,2) for w,_ in v]}")
