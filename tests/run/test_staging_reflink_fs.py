"""Local staging on real kernel filesystems (loop-mounted images, tests/support/loopfs.py): on XFS (reflink=1) and
btrfs every node's copy is a reflink that takes no data blocks and stays the node's own when written; where nothing
can be cloned (ext4, or the work folder and the broker home on two filesystems) the files are copied and a slow
copy says why and what makes it fast."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from broker.run import staging
from broker.run.launch import LocalExecutor, LocalLaunchSpec, prepare_node_dirs
from broker.run.staging import copy_hint, copy_staged, ext4_without_journal, fs_type, stage_plan
from tests.support.loopfs import loop_fs, loop_fs_missing

BIG = 32 << 20  # one file big enough that a data copy would show in the free space


def _need(kind: str) -> None:
    why = loop_fs_missing(kind)
    if why:
        pytest.skip(f"{kind} loop filesystem: {why}")


def _work(root: Path) -> Path:
    w = root / "w"
    (w / "pkg" / "sub").mkdir(parents=True)
    for i in range(40):
        (w / "pkg" / "sub" / f"m{i}.py").write_text(f"x = {i}\n" * 40)
    (w / "train.py").write_text("print('train')\n")
    (w / "empty.txt").write_bytes(b"")
    with open(w / "data.bin", "wb") as f:
        for _ in range(BIG >> 20):
            f.write(os.urandom(1 << 20))
    os.sync()  # written back, as a user's folder normally is (a reflink first flushes its source's dirty pages)
    return w


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _free(p: Path) -> int:
    os.sync()
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("kind", ["xfs", "btrfs"])
def test_a_reflink_filesystem_clones_every_file_and_the_copy_stays_the_nodes_own(kind):
    _need(kind)
    with loop_fs(kind) as mnt:
        assert fs_type(mnt) == kind
        w = _work(mnt)
        plan = stage_plan(w)
        nonempty = sum(1 for rel in plan.files if plan.source(rel).stat().st_size)
        before_free, before_digest = _free(mnt), _digest(w / "data.bin")
        node = mnt / "home" / "run" / "node0" / "work"
        ways = copy_staged(plan, node)
        assert ways["reflink"] == nonempty and ways["copy_file_range"] == ways["copy"] == 0
        assert ways["reflink_refused"] == 0
        assert before_free - _free(mnt) < BIG // 4  # the 32 MiB share their blocks: only metadata was written
        assert _digest(node / "data.bin") == before_digest
        assert stat.S_IMODE(node.stat().st_mode) == 0o700
        # a rank writing in place (a checkpoint over a staged file, r+ logs) changes its blocks only
        with open(node / "data.bin", "r+b") as f:
            f.seek(BIG // 2)
            f.write(b"\0" * 65536)
        with open(node / "train.py", "a") as f:
            f.write("print('changed on the node')\n")
        assert _digest(w / "data.bin") == before_digest
        assert (w / "train.py").read_text() == "print('train')\n"
        assert _digest(node / "data.bin") != before_digest


def test_two_filesystems_are_copied_and_a_slow_copy_names_them(tmp_path, monkeypatch):
    _need("xfs")
    with loop_fs("xfs") as mnt:
        w = _work(mnt)
        plan = stage_plan(w)
        ways = copy_staged(plan, tmp_path / "node0" / "work")
        assert ways["reflink"] == 0 and ways["reflink_refused"] == errno.EXDEV
        assert _digest(tmp_path / "node0" / "work" / "data.bin") == _digest(w / "data.bin")
        said: list[str] = []
        monkeypatch.setattr(staging, "SLOW_COPY_S", 0.0)
        prepare_node_dirs(w, tmp_path / "run", 2, plan, say=said.append)
        assert len(said) == 1, said
        line = said[0]
        nonempty = sum(1 for rel in plan.files if plan.source(rel).stat().st_size)  # an empty one is only created
        assert line.startswith("copying the work folder to 2 node(s) took ") and f"({nonempty} files per node" in line
        assert "two filesystems" in line and "(xfs)" in line and f"({fs_type(tmp_path)})" in line
        assert "BROKER_HOME" in line and ".brokerignore" in line


def test_a_filesystem_without_reflinks_says_so_through_the_run(tmp_path, monkeypatch):
    _need("ext4")
    with loop_fs("ext4") as mnt:
        w = _work(mnt)
        spec = LocalLaunchSpec(script_rel="train.py", args=[], workdir=w, nnodes=2, nproc_per_node=1, env={},
                               node_envs=[{}, {}], setup=[], expect=[], deadline_s=60)
        said: list[str] = []
        copied_when_said: list[bool] = []
        run_dir = mnt / "home" / "runs" / "r1"

        def say(text: str) -> None:
            said.append(text)
            copied_when_said.append((run_dir / "node1" / "work" / "train.py").exists())

        monkeypatch.setattr(staging, "SLOW_COPY_S", 0.0)
        ex = LocalExecutor(spec, run_dir, echo=None, say=say)
        assert ex.stage() is None
        assert [d.name for d in ex.dirs] == ["work", "work"]
        hint = [s for s in said if s.startswith("copying the work folder")]
        assert len(hint) == 1, said
        # "staged" is said once every node's copy exists (a 9 s copy printed it first, then nothing), the why after
        first = next(i for i, s in enumerate(said) if s.startswith("staged "))
        assert copied_when_said[first] and first < said.index(hint[0]), said
        assert "ext4 has no reflinks" in hint[0] and "XFS (reflink=1) or btrfs" in hint[0]
        assert "two filesystems" not in hint[0] and "journal" not in hint[0]
        # the same copy under the threshold says nothing
        said.clear()
        monkeypatch.setattr(staging, "SLOW_COPY_S", 3600.0)
        LocalExecutor(spec, mnt / "home" / "runs" / "r2", echo=None, say=said.append).stage()
        assert not [s for s in said if s.startswith("copying the work folder")]


def test_ext4_without_a_journal_is_told_apart_and_named_as_the_cause_of_a_slow_copy(monkeypatch):
    """A slow copy on this VM's root filesystem was blamed on its memory: ext4 mounted without a journal does not
    reuse the inodes of files deleted in the last minutes (Linux fs/ext4/ialloc.c, recently_deleted), so a copy right
    after a broker clean or an rm -rf took 9-14 s for cp -a as for broker.  The hint now says so, where it is so."""
    _need("ext4-nojournal")
    with loop_fs("ext4") as journaled, loop_fs("ext4-nojournal") as bare:
        assert fs_type(journaled) == fs_type(bare) == "ext4"
        assert ext4_without_journal(bare) and not ext4_without_journal(journaled)
        assert not ext4_without_journal(bare / "missing")
        w = _work(bare)
        monkeypatch.setattr(staging, "SLOW_COPY_S", 0.0)
        said: list[str] = []
        prepare_node_dirs(w, bare / "home" / "run", 2, stage_plan(w), say=said.append)
        assert len(said) == 1 and "this ext4 has no journal" in said[0], said
        assert "some minutes after many files were deleted" in said[0] and "cp -a" in said[0]
        assert "XFS (reflink=1)" in said[0]
    _need("xfs")
    with loop_fs("xfs") as mnt:
        assert not ext4_without_journal(mnt)


def test_the_journal_check_reads_the_kernels_lists(tmp_path):
    """/proc/fs/ext4/<dev> names an ext4 mount's device and /proc/fs/jbd2/<dev>-<n> its journal: no journal listed
    for a device ext4 knows is 'without'; a device ext4 does not list cannot be told (False)."""
    root = os.stat("/").st_dev
    link = f"/sys/dev/block/{os.major(root)}:{os.minor(root)}"
    if fs_type("/") != "ext4" or not os.path.islink(link):
        pytest.skip("the root filesystem is not ext4 on a block device here")
    dev = os.path.basename(os.readlink(link))
    proc = tmp_path / "proc"
    (proc / "ext4" / dev).mkdir(parents=True)
    assert ext4_without_journal("/", proc=str(proc))  # no jbd2 folder at all
    (proc / "jbd2" / "other-8").mkdir(parents=True)
    assert ext4_without_journal("/", proc=str(proc))
    (proc / "jbd2" / f"{dev}-8").mkdir()
    assert not ext4_without_journal("/", proc=str(proc))
    (proc / "ext4" / dev).rmdir()
    assert not ext4_without_journal("/", proc=str(proc))


def test_the_hint_is_silent_when_quick_or_cloned(tmp_path):
    quick = {"reflink": 0, "copy_file_range": 20_000, "copy": 0, "reflink_refused": errno.EOPNOTSUPP}
    assert copy_hint(quick, staging.SLOW_COPY_S - 0.1, 2, tmp_path, tmp_path) == ""
    cloned = {"reflink": 20_000, "copy_file_range": 0, "copy": 0, "reflink_refused": 0}
    assert copy_hint(cloned, 60.0, 2, tmp_path, tmp_path) == ""
    assert copy_hint({"reflink": 0, "copy_file_range": 0, "copy": 0}, 60.0, 2, tmp_path, tmp_path) == ""
    slow = copy_hint(quick, 9.04, 2, tmp_path, tmp_path)
    assert slow.startswith("copying the work folder to 2 node(s) took 9.0 s (10,000 files per node, each a full copy)")


def test_fs_type_agrees_with_findmnt(tmp_path):
    try:
        want = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(tmp_path)], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no findmnt")
    if not want:
        pytest.skip("findmnt names no filesystem here")
    assert fs_type(tmp_path) == want[-1]
    assert fs_type(tmp_path / "missing") == ""
