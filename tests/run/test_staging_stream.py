"""Staging mechanics: the streamed tar round-trips (content, permission bits, times, links staged as files) and
is never built in memory; local copies reflink / copy and never hard-link, so a node writing into its copy leaves
the user's file untouched; the copy falls back when the filesystem refuses a reflink or an in-kernel copy."""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from pathlib import Path

import pytest

from broker.run import staging
from broker.run.staging import copy_staged, stage_plan, staged_tar, worth_compressing, write_tar


def _work(tmp_path: Path) -> Path:
    w = tmp_path / "w"
    (w / "pkg" / "deep").mkdir(parents=True)
    (w / "train.py").write_text("print('hi')\n" * 100)
    (w / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(w / "run.sh", 0o750)
    (w / "pkg" / "deep" / "m.py").write_text("x = 1\n")
    os.chmod(w / "pkg" / "deep" / "m.py", 0o600)
    (w / "empty.txt").write_bytes(b"")
    (w / "blob.bin").write_bytes(os.urandom(3 << 20))  # incompressible, above the sampling size
    os.symlink("train.py", w / "same.py")  # staged as a regular file with train.py's content
    os.symlink("pkg", w / "pkglink")
    os.utime(w / "train.py", ns=(1_600_000_000_123_456_789, 1_600_000_000_987_654_321))
    return w


def _tree(d: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        if stat.S_ISREG(st.st_mode):
            out[p.relative_to(d).as_posix()] = (p.read_bytes(), stat.S_IMODE(st.st_mode), int(st.st_mtime))
        elif not stat.S_ISDIR(st.st_mode):
            out[p.relative_to(d).as_posix()] = ("not a regular file",)
    return out


@pytest.mark.parametrize("compress", [False, True, None])
def test_streamed_tar_round_trips_content_modes_times_and_links(tmp_path, compress):
    w = _work(tmp_path)
    plan = stage_plan(w)
    with staged_tar(plan, tmp_path / "run", compress=compress) as t:
        assert t.path.parent.parent == tmp_path / "run" and stat.S_IMODE(t.path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(t.path.stat().st_mode) == 0o600
        if compress is None:  # 3 MiB of random bytes outweigh the text: sent as it is
            assert t.compressed is False
        with open(t.path, "rb") as f:
            assert (f.read(2) == b"\x1f\x8b") == t.compressed
        out = tmp_path / "unpacked"
        out.mkdir()
        with tarfile.open(t.path, "r:*") as tar:
            assert all(m.isreg() for m in tar.getmembers())  # links arrive as files, never as links
            tar.extractall(out, filter="tar")
        tmpdir = t.path.parent
    assert not tmpdir.exists()  # removed on exit
    copy_staged(plan, tmp_path / "local")
    got, local = _tree(out), _tree(tmp_path / "local")
    assert got == local
    assert got["same.py"][0] == (w / "train.py").read_bytes()
    assert got["pkglink/deep/m.py"][0] == b"x = 1\n"
    # the owner's bits only (0750 -> 0700): a node's work folder is private, like the run folder it lies in
    assert got["run.sh"][1] == 0o700 and got["pkg/deep/m.py"][1] == 0o600
    assert got["train.py"][2] == 1_600_000_000
    assert "empty.txt" in got and got["empty.txt"][0] == b""


def test_write_tar_streams_in_small_writes(tmp_path):
    """The archive goes out as it is made: no write is anywhere near the size of the staged data."""
    w = tmp_path / "w"
    w.mkdir()
    (w / "a.bin").write_bytes(os.urandom(8 << 20))
    (w / "b.bin").write_bytes(os.urandom(8 << 20))
    writes: list[int] = []

    class Sink:
        def write(self, b) -> int:
            writes.append(len(b))
            return len(b)

        def tell(self) -> int:
            return sum(writes)

    write_tar(stage_plan(w), Sink(), compress=False)
    assert sum(writes) >= 16 << 20 and max(writes) <= 2 << 20


def test_worth_compressing_by_name_and_by_sample(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    (w / "train.py").write_text("for i in range(10):\n    print(i)\n" * 50_000)  # 1.6 MB of text
    assert worth_compressing(stage_plan(w))
    (w / "weights.safetensors").write_bytes(b"\0" * (4 << 20))  # compressed kind by name, however it looks
    assert not worth_compressing(stage_plan(w))
    (w / "weights.safetensors").unlink()
    (w / "data.raw").write_bytes(os.urandom(4 << 20))  # unknown name: the sample decides
    assert not worth_compressing(stage_plan(w))


def test_node_writes_never_reach_the_users_file(tmp_path):
    w = _work(tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in w.rglob("*")
              if p.is_file() and not p.is_symlink()}
    node = tmp_path / "node0" / "work"
    copy_staged(stage_plan(w), node)
    for rel in ("train.py", "pkg/deep/m.py", "run.sh"):
        assert (node / rel).stat().st_ino != (w / rel).stat().st_ino and (node / rel).stat().st_nlink == 1
    with open(node / "train.py", "r+b") as f:  # in place, as a job rewriting its copy does
        f.write(b"CHANGED BY THE NODE")
    (node / "pkg" / "deep" / "m.py").write_text("truncated and rewritten\n")
    with open(node / "same.py", "ab") as f:
        f.write(b"appended")
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in before}
    assert after == before


def _refuse(code: int):
    def fail(*_a, **_k):
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("clone_err,range_err", [(errno.EOPNOTSUPP, None), (errno.EXDEV, errno.EXDEV),
                                                 (errno.ENOTTY, errno.ENOSYS), (None, None)])
def test_copy_falls_back_and_learns_once_per_filesystem(tmp_path, monkeypatch, clone_err, range_err):
    import fcntl

    w = _work(tmp_path)
    calls = {"clone": 0, "range": 0}
    real_ioctl, real_range = fcntl.ioctl, os.copy_file_range

    def ioctl(fd, req, arg=0, *rest):
        if req == staging._FICLONE:
            calls["clone"] += 1
            if clone_err is None:  # a filesystem that clones: copy the bytes ourselves to stand in for it
                os.lseek(arg, 0, os.SEEK_SET)
                while chunk := os.read(arg, 1 << 16):
                    os.write(fd, chunk)
                return 0
            raise OSError(clone_err, os.strerror(clone_err))
        return real_ioctl(fd, req, arg, *rest)

    def copy_range(src, dst, count, *a):
        calls["range"] += 1
        if range_err is not None:
            raise OSError(range_err, os.strerror(range_err))
        return real_range(src, dst, count, *a)

    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    monkeypatch.setattr(os, "copy_file_range", copy_range)
    plan = stage_plan(w)
    ways = copy_staged(plan, tmp_path / "node")
    nonempty = sum(1 for rel in plan.files if plan.source(rel).stat().st_size)
    assert ways["reflink"] + ways["copy_file_range"] + ways["copy"] == nonempty
    assert ways["reflink_refused"] == (clone_err or 0)  # what a slow copy's hint is worded from
    if clone_err is None:
        assert ways["reflink"] == nonempty and calls["range"] == 0
    else:
        assert calls["clone"] == 1  # refused once: never asked again for the same pair of filesystems
        if range_err is None:
            assert ways["copy_file_range"] == nonempty
        else:
            assert calls["range"] == 1 and ways["copy"] == nonempty
    assert _tree(tmp_path / "node") == {k: v for k, v in _tree(_unpacked(plan, tmp_path)).items()}


def _unpacked(plan, tmp_path: Path) -> Path:
    out = tmp_path / "ref"
    out.mkdir()
    with staged_tar(plan, compress=False) as t, tarfile.open(t.path) as tar:
        tar.extractall(out, filter="tar")
    return out


def test_copy_error_that_is_not_a_refusal_is_raised(tmp_path, monkeypatch):
    import fcntl

    w = _work(tmp_path)
    monkeypatch.setattr(fcntl, "ioctl", _refuse(errno.ENOSPC))
    with pytest.raises(OSError) as e:
        copy_staged(stage_plan(w), tmp_path / "node")
    assert e.value.errno == errno.ENOSPC
