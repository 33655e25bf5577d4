"""A run's ``Host`` entries in broker's own ssh config (``<home>/ssh_config``, which ``broker ssh RUN --config
--install`` makes ``~/.ssh/config`` include): one block per run between markers, removed once the run's machines
are gone, so no entry keeps pointing at an address another machine may hold now."""

from __future__ import annotations

import os
from pathlib import Path

#: markers around one run's Host entries in broker's own ssh config
BEGIN, END = "# broker run {} begin", "# broker run {} end"


def own_config(home: Path | None = None) -> Path:
    """``<home>/ssh_config`` (without creating anything)."""
    from broker.core.config import home_path

    return Path(home or home_path()) / "ssh_config"


def without_run(text: str, run_id: str) -> str:
    """``text`` (an ssh config) without run ``run_id``'s block (unchanged when it has none)."""
    begin, end = BEGIN.format(run_id), END.format(run_id)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head.rstrip("\n") + ("\n\n" if head.strip() else "") + rest.split(end, 1)[1].lstrip("\n")
        text = text if text.strip() else ""
    return text


def forget_run_hosts(run_id: str, own: Path | None = None) -> bool:
    """Remove run ``run_id``'s Host block from broker's own ssh config; True when there was one.  The file is
    rewritten 0600 (created with that mode) and replaced atomically; never raises (a config that cannot be read or
    written is left as it is)."""
    path = own or own_config()
    try:
        old = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    new = without_run(old, run_id)
    if new == old:
        return False
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(new)
        os.replace(tmp, path)
    except OSError:
        return False
    return True
