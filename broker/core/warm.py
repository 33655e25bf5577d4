"""Import modules in the background while broker waits on something that is not the CPU.

The wait for a rented machine to report ``running`` leaves this process idle for seconds; the SSH executor's
modules (asyncssh alone is about a third of a second of CPU) would otherwise be imported only after the machine
runs, while it bills and the job waits.  :func:`warm_imports` imports them on a daemon thread during that wait.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Iterable

_log = logging.getLogger(__name__)


def warm_imports(names: Iterable[str], *, then: str | None = None) -> threading.Thread:
    """Import ``names`` in order on a daemon thread and return it (started).  ``then``: the name of a tuple of
    module names in the last module (``"REACH_MODULES"``), imported next, so a module keeps the list of what its
    own steps import lazily.

    An import that fails is left for the real import to raise with its context (logged at debug here); a module
    half-imported by this thread is finished by whichever thread needs it first (Python's per-module import
    locks), so the main thread never sees a partial module."""
    names = list(names)

    def work() -> None:
        mod = None
        for name in names:
            mod = _try_import(name)
        for name in (getattr(mod, then, ()) if then and mod is not None else ()):
            _try_import(name)

    t = threading.Thread(target=work, name="broker-warm-imports", daemon=True)
    t.start()
    return t


def _try_import(name: str):
    """The module ``name``, or None when its import fails (logged at debug: the real import raises it where it
    matters)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        _log.debug("warm import of %s failed: %s", name, e)
        return None
