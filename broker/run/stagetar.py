"""The staged files (:func:`broker.run.staging.stage_plan`) packed as one tar for SSH and Slurm uploads: written once
to local disk (:class:`staged_tar`) and streamed to every node, gzip-compressed only when that pays
(:func:`worth_compressing`)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.run.staging import StagePlan


#: file name endings whose content is already compressed (or is packed numbers that gzip barely shrinks): a tar
#: of mostly these is sent as it is
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".7z", ".rar", ".jpg", ".jpeg",
                       ".png", ".webp", ".gif", ".mp4", ".mkv", ".webm", ".mp3", ".flac", ".ogg", ".parquet",
                       ".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".npz", ".h5", ".arrow", ".whl", ".tfrecord")

#: files at least this big are sampled (their first 64 KiB compressed) instead of judged by their name alone
_SAMPLE_BYTES = 1 << 20


def worth_compressing(plan: StagePlan) -> bool:
    """Whether gzip would pay for the staged files: True when at least half of the bytes look compressible (not
    an already-compressed kind by name, and for files of 1 MiB or more a first 64 KiB that zlib shrinks by at
    least 10 %).  Measured on the shared 2-core machine (bench/staging_scale.py): gzip of 1 GiB of incompressible
    data took 23 s of CPU for nothing, faster than most links only for source-like text."""
    import zlib

    good = 0
    for rel in plan.files:
        src = plan.source(rel)
        try:
            size = src.stat().st_size
        except OSError:
            continue
        if rel.name.lower().endswith(COMPRESSED_SUFFIXES):
            continue
        if size >= _SAMPLE_BYTES:
            try:
                with open(src, "rb") as f:
                    head = f.read(1 << 16)
            except OSError:
                continue
            if len(zlib.compress(head, 1)) > 0.9 * len(head):
                continue
        good += size
    return good * 2 >= plan.total_bytes


@dataclass
class StagedTar:
    """The staged files as one tar archive on local disk: ``path``, gzip-compressed when ``compressed`` (then the
    node unpacks it with ``tar -xzf``, else ``tar -xf``)."""

    path: Path
    compressed: bool

    @property
    def tar_flags(self) -> str:
        """``-xzf`` or ``-xf``: what unpacks it."""
        return "-xzf" if self.compressed else "-xf"


def _owner_only(info):
    """A tar member with the owner's permission bits only (as :func:`copy_staged` gives local copies): a node's
    work folder is private, also on a cluster's shared file system."""
    info.mode &= 0o700
    return info


def write_tar(plan: StagePlan, out, *, compress: bool) -> None:
    """Stream the planned files as a tar into the binary file object ``out`` (``write`` and ``tell``; gzip level 1
    when ``compress``),
    paths relative to the work folder, each a regular file with its owner's permission bits and its times (a
    linked file's content, never a link): memory stays constant whatever the sizes."""
    import gzip
    import tarfile

    # tarfile's own "w|gz" compresses at level 9 (no level in stream mode before Python 3.12): gzip around it
    gz = gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1, mtime=0) if compress else None
    try:
        # plain "w" on the caller's file object writes each block straight through ("w|" gathers them in a bytes
        # buffer that is copied on every write); 1 MiB copy blocks instead of 16 KiB
        with tarfile.TarFile(fileobj=gz or out, mode="w", dereference=True, copybufsize=1 << 20) as tar:
            for rel in plan.files:
                tar.add(str(plan.source(rel)), arcname=rel.as_posix(), recursive=False, filter=_owner_only)
    finally:
        if gz is not None:
            gz.close()  # writes the gzip trailer; ``out`` stays open (the caller's)


class staged_tar:
    """``with staged_tar(plan, folder) as t:`` the planned files as a :class:`StagedTar` in a private temporary
    folder under ``folder`` (default: the system's), written once and shared by every node's upload, removed on
    exit.  ``compress``: None decides by :func:`worth_compressing`."""

    def __init__(self, plan: StagePlan, folder: Path | None = None, *, compress: bool | None = None):
        self.plan, self.folder, self.compress = plan, folder, compress
        self._dir: str | None = None

    def __enter__(self) -> StagedTar:
        import tempfile

        if self.folder is not None:
            Path(self.folder).mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="stage-", dir=self.folder)  # 0700: the user's files
        compress = worth_compressing(self.plan) if self.compress is None else self.compress
        path = Path(self._dir) / ("work.tar.gz" if compress else "work.tar")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            write_tar(self.plan, f, compress=compress)
        return StagedTar(path, compress)

    def __exit__(self, *exc: object) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def tar_staged(plan: StagePlan) -> bytes:
    """The planned files as one tar.gz in memory (paths relative to the work folder), each a regular file as in
    :func:`copy_staged`.  Small folders only: uploads stream a :func:`staged_tar` file instead."""
    import io

    buf = io.BytesIO()
    write_tar(plan, buf, compress=True)
    return buf.getvalue()
