"""A real filesystem of a given kind (``xfs`` with reflink=1, ``btrfs``, ``ext4``, ``ext4-nojournal``) in a sparse
image file, loop mounted in a temporary folder and unmounted on exit: the reflink path of local staging is tried on
a kernel filesystem, not on a patched ioctl.  Needs root, a loop device and the type's ``mkfs`` (scripts/test installs
xfsprogs and btrfs-progs when root); :func:`loop_fs_missing` says what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: mkfs arguments per kind: XFS's reflink=1 is the default since xfsprogs 5.1, said anyway; ``ext4-nojournal`` is
#: ext4 made without a journal (as some VM images' root filesystems are)
MKFS = {"xfs": ["-q", "-f", "-m", "reflink=1"], "btrfs": ["-q", "-f"], "ext4": ["-q", "-F"],
        "ext4-nojournal": ["-q", "-F", "-O", "^has_journal"]}


def fs_of(kind: str) -> str:
    """The filesystem type a ``kind`` of :data:`MKFS` makes (``ext4-nojournal`` -> ``ext4``)."""
    return kind.partition("-")[0]


def _filesystems() -> set[str]:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in text.splitlines() if line.split()}


def loop_fs_missing(kind: str) -> str:
    """Why a ``kind`` loop filesystem cannot be made here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (mount)"
    if not Path("/dev/loop-control").exists():
        return "no loop devices (/dev/loop-control)"
    if fs_of(kind) not in _filesystems():
        return f"the kernel has no {fs_of(kind)} (/proc/filesystems)"
    if not shutil.which(f"mkfs.{fs_of(kind)}"):
        return f"mkfs.{fs_of(kind)} is not installed"
    return ""


@contextmanager
def loop_fs(kind: str, size_mib: int = 1024, where: str | None = None) -> Iterator[Path]:
    """The mount point of a fresh ``kind`` filesystem of ``size_mib`` MiB (a sparse file under ``where``, default
    the system temporary folder); unmounted and deleted afterwards.  Raises RuntimeError (with what is missing or
    mkfs/mount's stderr) when it cannot be made."""
    missing = loop_fs_missing(kind)
    if missing:
        raise RuntimeError(f"no {kind} loop filesystem: {missing}")
    with tempfile.TemporaryDirectory(prefix=f"broker-{kind}-", dir=where) as d:
        img, mnt = Path(d) / f"{kind}.img", Path(d) / "mnt"
        mnt.mkdir()
        with open(img, "wb") as f:
            f.truncate(size_mib << 20)
        for argv in ([f"mkfs.{fs_of(kind)}", *MKFS[kind], str(img)], ["mount", "-o", "loop", str(img), str(mnt)]):
            p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            if p.returncode:
                raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()[-500:]}")
        try:
            yield mnt
        finally:
            # "-o loop" mounts detach their loop device on unmount; a lazy unmount if something still holds it
            if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=120).returncode:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=120)
