"""Folders 0700 and files 0600, created with their final mode (:mod:`broker.core.private` says why).

The stdlib-only primitives under :mod:`broker.core.private` and :mod:`broker.core.config` (which creates the broker home
with them): importing this module imports nothing of broker.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_opener(path: str, flags: int) -> int:
    """``opener`` for :func:`open`: creates the file 0600 (never following a symlink in its last component)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)


def write_private(path: Path | str, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` as a 0600 file (created with that mode; an existing file with a wider mode is
    narrowed *before* anything is written).  Raises OSError (ELOOP for a symlink at ``path``)."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o077:  # a file an older broker wrote 0644: narrow it while it is empty
            os.fchmod(fd, FILE_MODE)
        raw = data.encode() if isinstance(data, str) else data
        view = memoryview(raw)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
    return p


def private_dir(d: Path | str) -> Path:
    """Create folder ``d`` 0700 (its missing parents with the usual mode) and return it.  A folder that exists
    is left as it is; :func:`tighten_dir` narrows one broker made earlier.  Raises OSError."""
    p = Path(d)
    if not p.is_dir():
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(p, DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened: 0700 under any umask
        except FileExistsError:
            if not p.is_dir():
                raise
    return p


def private_dirs(d: Path | str) -> Path:
    """Create folder ``d`` and every missing folder above it 0700 (``os.makedirs`` gives the parents the umask's
    mode): for the folders inside a run folder (``node0/work``, ``artifacts/node1``).  Returns ``d``; raises
    OSError."""
    p = Path(d)
    missing = []
    q = p
    while not q.is_dir():
        missing.append(q)
        if q.parent == q:
            break
        q = q.parent
    for m in reversed(missing):
        try:
            os.mkdir(m, DIR_MODE)
        except FileExistsError:
            if not m.is_dir():
                raise
    return p


def tighten_dir(d: Path | str) -> None:
    """Narrow folder ``d`` to 0700 when this user owns it, it is wider and it is not a shared folder (sticky bit:
    /tmp).  For homes and run folders an older broker created 0755; best effort (never raises)."""
    try:
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 \
                and not st.st_mode & stat.S_ISVTX:
            os.chmod(d, DIR_MODE)
    except OSError:
        pass


def tighten_file(p: Path | str) -> None:
    """Narrow an existing regular file this user owns to 0600 (a ledger an older broker wrote 0644); best effort."""
    try:
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(p, FILE_MODE)
    except OSError:
        pass
