"""What of a recipe's ``workdir`` is copied to the nodes: one staging rule for every executor.

:func:`stage_plan` walks the work folder once and returns the files to copy; local runs copy them into each node's
folder, SSH runs pack them into one tar.gz, Slurm runs copy them to the job folder.  What is never copied:

* always: ``.git``, virtual environments (``.venv``, ``venv``, any folder holding a ``pyvenv.cfg``),
  ``node_modules``, ``__pycache__``/``*.pyc``, ``.env`` and ``.env.*`` files, SSH and cloud keys (``id_*`` key
  files, ``*.pem``, ``*.key``, ``*.p12``, ``*.pfx``, ``.ssh``, ``.oci``, ``.aws``, ``.vast_api_key``);
* what the work folder's ``.gitignore`` and ``.brokerignore`` exclude (git's wildmatch rules, through the
  `pathspec <https://pypi.org/project/pathspec/>`_ library; nested ``.gitignore`` files are honoured too).

The staged size per node is reported (:attr:`StagePlan.total_bytes`); above :data:`WARN_BYTES` the caller warns.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

#: staged size per node above which a run warns (bytes): 100 MB
WARN_BYTES = 100 * 1000 * 1000

#: names (files or folders, at any depth) never copied to a node
ALWAYS_SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "node_modules", "__pycache__", ".mypy_cache",
                    ".pytest_cache", ".ssh", ".oci", ".aws", ".tox"}
#: gitignore-style patterns never copied to a node (secrets and keys)
ALWAYS_SKIP_PATTERNS = [".env", ".env.*", "*.pyc", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.pem",
                        "*.key", "*.p12", "*.pfx", ".vast_api_key", "vast_api_key", ".netrc", "*.ppk"]


@dataclass
class StagePlan:
    """The files of ``root`` to copy (paths relative to ``root``), their total size in bytes, and what was skipped
    by which rule (first few names per rule, for the log)."""

    root: Path
    files: list[Path] = field(default_factory=list)
    total_bytes: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def size_text(self) -> str:
        """``1.2 MB`` style size of what is staged."""
        b = float(self.total_bytes)
        for unit in ("B", "kB", "MB", "GB"):
            if b < 1000 or unit == "GB":
                return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
            b /= 1000
        return f"{b:.1f} GB"  # pragma: no cover

    def summary(self) -> str:
        """One line: ``staged 12 files, 1.2 MB per node (skipped: .git, .env)``."""
        skipped = sorted({n for names in self.skipped.values() for n in names})
        more = f" (not copied: {', '.join(skipped[:6])}{', ...' if len(skipped) > 6 else ''})" if skipped else ""
        return f"staged {len(self.files)} file(s), {self.size_text()} per node from {self.root}{more}"

    @property
    def too_big(self) -> bool:
        return self.total_bytes > WARN_BYTES


def _spec(lines: list[str]):
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _read_ignore(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _is_venv(d: Path) -> bool:
    return (d / "pyvenv.cfg").is_file()


def stage_plan(root: Path) -> StagePlan:
    """Walk ``root`` and decide what to copy (see the module docstring).  Symbolic links to files are followed;
    links to folders are not entered.  Raises FileNotFoundError when ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"work folder {root} does not exist")
    always = _spec(ALWAYS_SKIP_PATTERNS)
    plan = StagePlan(root=root)
    # (folder relative to root, spec of that folder's .gitignore/.brokerignore) from the root down
    specs: list[tuple[str, object]] = []

    def note(rule: str, name: str) -> None:
        lst = plan.skipped.setdefault(rule, [])
        if len(lst) < 20:
            lst.append(name)

    def ignored(rel: str, is_dir: bool) -> bool:
        probe = rel + "/" if is_dir else rel
        for base, spec in specs:
            sub = probe if not base else (probe[len(base) + 1:] if probe.startswith(base + "/") else None)
            if sub and spec.match_file(sub):  # type: ignore[attr-defined]
                return True
        return False

    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        rel_dir = "" if d == root else d.relative_to(root).as_posix()
        lines = _read_ignore(d / ".gitignore") + _read_ignore(d / ".brokerignore")
        if lines:
            specs.append((rel_dir, _spec(lines)))
        keep_dirs = []
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name in ALWAYS_SKIP_DIRS or _is_venv(d / name):
                note("always", name + "/")
            elif (d / name).is_symlink():
                note("symlinked folder", rel + "/")
            elif ignored(rel, True):
                note("ignore file", rel + "/")
            else:
                keep_dirs.append(name)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if always.match_file(name):
                note("always", name)
                continue
            if ignored(rel, False):
                note("ignore file", rel)
                continue
            p = d / name
            try:
                size = p.stat().st_size
            except OSError:  # dangling link
                note("unreadable", rel)
                continue
            plan.files.append(Path(rel))
            plan.total_bytes += size
    return plan


def copy_staged(plan: StagePlan, dst: Path) -> None:
    """Copy the planned files into ``dst`` (created; an existing ``dst`` is replaced)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for rel in plan.files:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(plan.root / rel, target)


def tar_staged(plan: StagePlan) -> bytes:
    """The planned files as one tar.gz (paths relative to the work folder)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in plan.files:
            tar.add(str(plan.root / rel), arcname=rel.as_posix(), recursive=False)
    return buf.getvalue()
