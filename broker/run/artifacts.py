"""Bringing a run's artifacts home: the recipe's patterns matched in each node's work folder, copied under
``<run dir>/artifacts/node<i>/`` within per-file, per-run and file-count limits (:class:`ArtifactBudget`), never
outside that folder.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from broker.run.supervisor import READ_CHUNK, RunResult


# --------------------------------------------------------------------------------------------------- artifacts
# A node is input, not authority: the names it sends back and the files behind them are checked before anything is
# written here.  Names must be relative, without ``..``, and land inside ``<run>/artifacts/node<i>/``; a file must
# be a regular file inside the node's work folder (a symlink out of it is refused); sizes are bounded.

#: the most one artifact may hold (GiB), all the artifacts of a run together (GiB), and how many files one node
#: may send back; the environment (never a folder's ``.env``) may raise the first two
ARTIFACT_MAX_GIB = 20.0
ARTIFACTS_MAX_GIB = 100.0
ARTIFACT_MAX_FILES = 10_000
GIB = 1 << 30


class RefusedArtifact(ValueError):
    """An artifact broker will not collect; the message says why (the name is the caller's to add)."""


class OverCap(RefusedArtifact):
    """A file refused because it would pass a size cap of an :class:`ArtifactBudget` (the rest of a copy that
    must stay whole, a checkpoint, cannot go on without it)."""


def _gib_setting(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        v = float(raw) if raw else default
    except ValueError:
        return default
    return v if v > 0 else default


@dataclass
class ArtifactBudget:
    """The size bounds of one run's artifact collection (bytes), and what was collected so far."""

    per_file: int = field(default_factory=lambda: int(_gib_setting("BROKER_ARTIFACT_MAX_GIB", ARTIFACT_MAX_GIB) * GIB))
    total: int = field(default_factory=lambda: int(_gib_setting("BROKER_ARTIFACTS_MAX_GIB", ARTIFACTS_MAX_GIB) * GIB))
    max_files: int = ARTIFACT_MAX_FILES
    used: int = 0

    def check(self, size: int) -> None:
        """Raises RefusedArtifact when a file of ``size`` bytes is over a cap (given what was collected)."""
        if size > self.per_file:
            raise OverCap(f"{_size(size)} is over the {_size(self.per_file)} cap for one artifact "
                                  "(BROKER_ARTIFACT_MAX_GIB raises it)")
        if self.used + size > self.total:
            raise OverCap(f"{_size(size)} would bring the run's artifacts over the {_size(self.total)} cap "
                                  "for all of them (BROKER_ARTIFACTS_MAX_GIB raises it)")


def _size(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def artifact_destination(root: Path, name: object) -> Path:
    """Where the artifact ``name`` (a path relative to a node's work folder, as the node sent it back) goes under
    ``root`` (``<run>/artifacts/node<i>``).  Raises RefusedArtifact for a name that is not a string, is empty, holds
    control characters, is absolute, climbs out with ``..``, or resolves outside ``root`` (a symlink there)."""
    if not isinstance(name, str) or not name.strip():
        raise RefusedArtifact("not a file name")
    if any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F for c in name):
        raise RefusedArtifact("the name holds control characters")
    if name.startswith("/") or Path(name).is_absolute():
        raise RefusedArtifact("an absolute path: artifacts are paths relative to the node's work folder")
    parts = Path(name).parts
    if ".." in parts:
        raise RefusedArtifact("the name climbs out of the work folder with '..'")
    parts = tuple(p for p in parts if p != ".")
    if not parts:
        raise RefusedArtifact("not a file name")
    dst = root.joinpath(*parts)
    base = os.path.realpath(root)
    if not os.path.realpath(dst).startswith(base.rstrip("/") + "/"):
        raise RefusedArtifact(f"it would be written outside {root}")
    return dst


def open_artifact(dst: Path) -> "Any":
    """A new file at ``dst`` for writing (binary, mode 0600), never through a symlink; its folders are created
    0700."""
    from broker.core.private import private_dirs

    private_dirs(dst.parent)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    return os.fdopen(fd, "wb")


def write_capped(dst: Path, chunks: "Iterable[bytes]", budget: ArtifactBudget) -> int:
    """Write ``chunks`` to the new file ``dst`` (:func:`open_artifact`) within ``budget`` (counted as it comes: a
    file may grow, or its size be misreported); returns the bytes written.  Over a cap the partial file is removed
    and RefusedArtifact raised."""
    got = 0
    try:
        with open_artifact(dst) as out:
            for data in chunks:
                got += len(data)
                budget.check(got)
                out.write(data)
    except BaseException:
        try:
            os.unlink(dst)
        except OSError:
            pass
        raise
    budget.used += got
    return got


def match_artifacts(workdir: Path, patterns: list[str]) -> list[str]:
    """Files under ``workdir`` matching the recipe's ``artifacts`` globs (``**`` allowed), relative paths, sorted.
    Patterns that are absolute or climb out with ``..`` match nothing."""
    out: set[str] = set()
    for pat in patterns:
        if Path(pat).is_absolute() or ".." in Path(pat).parts:
            continue
        for p in workdir.glob(pat):
            if p.is_file() or p.is_symlink():
                out.add(p.relative_to(workdir).as_posix())
    return sorted(out)


def collect_local(workdir: Path, patterns: list[str], root: Path, budget: ArtifactBudget,
                  node: int = 0) -> tuple[list[str], list[str]]:
    """Copy the files of ``workdir`` that match ``patterns`` (on this machine) into ``root`` within ``budget``;
    returns (names collected, ``'name' (why)`` for each one refused: a symlink out of ``workdir``, not a regular
    file, over a size cap)."""
    got, refused = [], []
    base = os.path.realpath(workdir).rstrip("/") + "/"
    for rel in match_artifacts(workdir, patterns):
        try:
            dst = artifact_destination(root, rel)
            real = os.path.realpath(workdir / rel)
            if not real.startswith(base):
                raise RefusedArtifact(f"a symlink to {real!r}, outside node {node}'s work folder")
            if not os.path.isfile(real):
                raise RefusedArtifact("not a regular file")
            if len(got) >= budget.max_files:
                raise RefusedArtifact(f"more than {budget.max_files} files")
            budget.check(os.stat(real).st_size)

            def _read(path: str = real) -> Iterable[bytes]:
                with open(path, "rb") as f:
                    while data := f.read(READ_CHUNK):
                        yield data

            write_capped(dst, _read(), budget)
            got.append(rel)
        except RefusedArtifact as e:
            refused.append(f"{rel!r} ({e})")
    return got, refused


def record_artifacts(result: RunResult, patterns: list[str], found: dict[int, list[str]], run_dir: Path,
                     echo: Callable[[str], None] | None, refused: dict[int, list[str]] | None = None) -> None:
    """Log what was collected from each node into ``run_dir/artifacts/node<i>/`` (in rank 0's log and on the
    console); a pattern that no node produced fails a succeeded run with that name (the job did not make what it promised); an artifact
    broker refused (``refused``: node -> ``'name' (why)``) fails the run and is named in its reason."""
    lines = []
    for i, names in sorted(found.items()):
        if names:
            lines.append(f"artifacts from node {i}: {', '.join(names)} -> {run_dir / 'artifacts' / f'node{i}'}")
    bad = [f"node {i}: {r}" for i, rs in sorted((refused or {}).items()) for r in rs]
    for b in bad:
        lines.append(f"artifact refused, nothing written for it: {b}")
    missing = []
    for pat in patterns:
        if Path(pat).is_absolute() or ".." in Path(pat).parts:
            lines.append(f"artifact {pat!r} skipped: give a path relative to the work folder")
            missing.append(pat)
            continue
        hit = any(fnmatch.fnmatch(n, pat) or Path(n).match(pat) for names in found.values() for n in names)
        if not hit:
            missing.append(pat)
            # a run that already failed wrote nothing because it stopped first: naming each missing file in the
            # log would read as a second fault; only a succeeded run that skipped its promise is told so
            if result.status == "succeeded":
                lines.append(f"artifact {pat} was produced by no node")
    if result.log_paths.get(0) is not None and result.log_paths[0].exists():
        with open(result.log_paths[0], "a", encoding="utf-8") as f:
            f.writelines(f"broker: {ln}\n" for ln in lines)
    if echo:
        for ln in lines:
            echo(f"[broker] {ln}")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more (see node 0's log)" if len(bad) > 5 else "")
        why = f"artifact(s) refused: {shown}"
        if result.status == "succeeded":
            result.status, result.reason = "failed", why
        else:
            result.reason = f"{result.reason}; {why}" if result.reason else why
    if missing and result.status == "succeeded":
        result.status = "failed"
        result.reason = "listed artifact(s) produced by no node: " + ", ".join(missing)
