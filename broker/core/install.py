"""How to install one of broker's optional extras (``gcp``, ``aws``, ``oci``, ``vast``), worded for the way broker
itself was installed: from a source checkout (``pip install -e .``, the ``scripts/install`` way) the extra must go
into that checkout's environment, since a bare ``pip install 'broker[gcp]'`` asks the package index for a package
named "broker", which is not this one.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse


def checkout_dir() -> Path | None:
    """The source folder broker was installed from (a ``direct_url.json`` naming a ``file://`` folder, editable or
    not), or None for an install from a package index / wheel file, or when the metadata cannot be read.

    Every installed ``broker`` record is read, not only the first one found: ``python -m broker`` run inside a
    checkout finds the checkout's own ``broker.egg-info`` (which has no ``direct_url.json``) before the
    environment's record of the install."""
    from importlib import metadata

    for dist in _broker_records(metadata):
        try:
            raw = dist.read_text("direct_url.json")
            info = json.loads(raw) if raw else None
        except (OSError, ValueError):  # written by pip, but a broken file must not break an error message
            continue
        url = info.get("url", "") if isinstance(info, dict) else ""
        if isinstance(info, dict) and "dir_info" in info and url.startswith("file://"):
            path = Path(unquote(urlparse(url).path))
            if (path / "pyproject.toml").is_file():
                return path
    return None


def _broker_records(metadata):
    """The ``broker`` distribution records on the path: the first one found, then every one."""
    try:
        yield metadata.distribution("broker")
    except (metadata.PackageNotFoundError, OSError):
        pass
    try:
        yield from metadata.distributions(name="broker")
    except OSError:
        pass


def _shown(path: Path, cwd: Path, *, dot: bool = False) -> str:
    """``path`` relative to ``cwd`` when under it, else absolute; ``dot``: a relative path starts with ``./`` (pip
    reads a bare word as a package name, and ``pip`` alone would be looked up on PATH)."""
    try:
        rel = str(path.relative_to(cwd))
    except ValueError:
        return str(path)
    if rel == ".":
        return "."
    return f"./{rel}" if dot or "/" not in rel else rel


def install_hint(extra: str, packages: str = "", *, cwd: Path | None = None) -> str:
    """The command that installs broker's ``extra`` in backticks (with ``packages``, e.g. "google-cloud-compute,
    google-auth", named after it), one line.  From a checkout: this interpreter's pip, ``install -e '<checkout>[extra]'``, paths
    relative to ``cwd`` (default: the current folder) when under it, e.g. ``.venv/bin/pip install -e '.[gcp]'``;
    otherwise ``pip install 'broker[extra]'``.  Raises nothing."""
    here = cwd or Path.cwd()
    src = checkout_dir()
    if src is None:
        cmd = f"pip install {shlex.quote(f'broker[{extra}]')}"
    else:
        pip = Path(sys.executable).with_name("pip")
        pip_s = _shown(pip, here) if pip.exists() else f"{_shown(Path(sys.executable), here)} -m pip"
        cmd = f"{pip_s} install -e {shlex.quote(f'{_shown(src, here, dot=True)}[{extra}]')}"
    # backticked: the terminal's wrapping keeps a `command` whole (it split `pip install -e` / `'.[gcp]'`)
    return f"`{cmd}` ({packages})" if packages else f"`{cmd}`"
