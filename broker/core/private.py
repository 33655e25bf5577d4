"""Private by default: folders 0700 and files 0600 created with their final mode, a per-user runtime folder for
sockets and locks, and which names are secrets.

Every file broker writes that can carry a secret or a fact about the user's cloud (the ledger, ``recipe.json``,
``plan.json``, keys, the run folders) is created here with ``os.open(..., mode)``: under any umask there is no
moment where it is readable by another user, and nothing is ``chmod``-ed after the content is written.

Sockets (SSH ``ControlPath``) and locks live in :func:`runtime_dir`, never in shared ``/tmp`` where another local
user could bind the socket first or plant a symlink: the platform's user runtime folder (``$XDG_RUNTIME_DIR`` /
``/run/user/<uid>``, platformdirs) when it exists, else ``<broker home>/run`` (0700).  The folder's owner and
mode are checked before use (:func:`check_private_dir`).

Secret names: a recipe ``env:`` name that contains ``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD`` or ``PASSWD``
(any case) is masked wherever it is stored or printed (:func:`looks_secret`); the cloud credentials broker itself
reads are never handed to a local job (:func:`credential_names`).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from broker.core.errors import BadInput
# the file and folder primitives live one module down (broker.core.config creates the home with them, and this module
# reads the settings of broker.core.config); re-exported, as they are this module's subject
from broker.core.fsmode import (  # noqa: F401
    DIR_MODE, FILE_MODE, private_dir, private_dirs, private_opener, tighten_dir, tighten_file, write_private)


#: what a masked value shows instead of the value
MASK = "********"

#: names whose values are secrets (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``), case-insensitive
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD", re.IGNORECASE)

#: the longest unix-socket path (``sun_path`` is 108 bytes with its NUL); ssh binds ``<ControlPath>.<16 random
#: characters>`` first and renames it, so a ControlPath must leave 17 bytes for that
SUN_PATH_MAX = 107
SSH_TEMP_SUFFIX = 17
#: where the short runtime folder goes when the home's path is too long for a socket (``/tmp/broker-<uid>``)
SHORT_BASE = Path("/tmp")
#: length of ssh's ``%C`` (a SHA-1 hash of the connection, in hex)
SSH_HASH_LEN = 40


def looks_secret(name: str) -> bool:
    """True when the variable ``name`` looks like it holds a secret (``*KEY*``, ``*TOKEN*``, ``*SECRET*``,
    ``*PASSWORD*``, ``*PASSWD*``; any case)."""
    return bool(SECRET_NAME.search(name))


#: shortest value the log scrubber replaces
MIN_SCRUB_LEN = 6
#: values of this process's recipe secrets (``secrets:``): every log line is scrubbed of them (broker.cli.app.scrub)
_SECRETS: set[str] = set()


def register_secret(value: str) -> None:
    """Remember ``value`` as a secret of this process: :func:`known_secrets` gives it to the log scrubber.
    Values shorter than :data:`MIN_SCRUB_LEN` are not (masking them would mangle every line that holds them)."""
    if value and len(value) >= MIN_SCRUB_LEN:
        _SECRETS.add(value)


def known_secrets() -> list[str]:
    """The secret values registered so far, longest first (so a value that contains another is masked whole)."""
    return sorted(_SECRETS, key=len, reverse=True)


#: the password of a URL with credentials (``scheme://user:password@host``): group 1 the part before it
URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)([^@/\s]+)@")


def url_passwords(text: str) -> list[str]:
    """The passwords of every URL with credentials in ``text`` (``scheme://user:password@host``)."""
    return [m.group(2) for m in URL_CREDENTIALS.finditer(text)]


def mask_url_credentials(text: str) -> str:
    """``text`` with the password of every URL with credentials replaced by :data:`MASK`
    (``postgres://u:********@db``)."""
    return URL_CREDENTIALS.sub(lambda m: m.group(1) + MASK + "@", text) if "://" in text else text


def mask_secrets(text: str, values: "list[str] | None" = None) -> str:
    """``text`` with every registered secret value (or ``values``) replaced by :data:`MASK`."""
    for v in (known_secrets() if values is None else values):
        if v and v in text:
            text = text.replace(v, MASK)
    return text


class StreamScrubber:
    """Masks secret values in a byte stream cut into arbitrary blocks (a node's output): :meth:`feed` returns
    the block with every value replaced by :data:`MASK`, holding back the end of the block only while it could be
    the start of a value (at most ``len(longest value) - 1`` bytes), so a value split across two blocks is caught
    too; :meth:`flush` returns what is held at the end of the stream.  ``values``: default the registered ones."""

    def __init__(self, values: "list[str] | None" = None) -> None:
        vals = known_secrets() if values is None else sorted(values, key=len, reverse=True)
        self._text_values = [v for v in vals if v]
        self._values = [v.encode("utf-8", "surrogatepass") for v in self._text_values]
        self._mask = MASK.encode()
        self._held: "bytes | str" = b""

    def __bool__(self) -> bool:
        return bool(self._values)

    def feed(self, data: "bytes | str") -> "bytes | str":
        """``data`` masked, of its own type: a stream of text blocks (an SSH node's decoded output) is masked as
        text, a stream of bytes as bytes (one stream never mixes the two)."""
        text = isinstance(data, str)
        values, mask = (self._text_values, MASK) if text else (self._values, self._mask)
        buf = self._held + data if self._held else data
        for v in values:
            if v in buf:
                buf = buf.replace(v, mask)
        keep = 0
        for v in values:  # the longest end of buf that begins a value: held until the next block
            for k in range(min(len(v) - 1, len(buf)), keep, -1):
                if buf.endswith(v[:k]):
                    keep = k
                    break
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep]
        self._held = buf[:0]
        return buf

    def flush(self) -> "bytes | str":
        held, self._held = self._held, self._held[:0]
        return held


# --------------------------------------------------------------------------------------------------- runtime
def check_private_dir(d: Path | str, *, what: str = "runtime folder") -> Path:
    """``d`` when it is a real folder (not a symlink) owned by this user with no group/other access; BadInput
    naming the folder and the fix otherwise (another user made it, or a symlink is planted there)."""
    p = Path(d)
    try:
        st = os.lstat(p)
    except OSError as e:
        raise BadInput(f"broker's {what} {p} cannot be read: {e.strerror or e}",
                       hint="set BROKER_HOME to a folder you own") from None
    problem = ""
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to user id {st.st_uid}, not to you ({os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700"
    if problem:
        raise BadInput(f"broker's {what} {p} {problem}: another user could read or replace its sockets and locks",
                       hint=f"remove it (rm -r {p}) and run again; broker creates it 0700")
    return p


def _make_checked(d: Path) -> Path:
    private_dir(d)
    return check_private_dir(d)


def runtime_dir(*, socket_room: int = 0) -> Path:
    """The per-user folder (0700, checked) for broker's sockets and locks.

    The platform's user runtime folder (``$XDG_RUNTIME_DIR/broker``, ``/run/user/<uid>/broker``) when its parent
    exists and is this user's, else ``<broker home>/run``.  ``socket_room``: bytes a socket name inside it needs;
    when the home's folder would make a socket path longer than :data:`SUN_PATH_MAX`, a 0700 folder
    ``/tmp/broker-<uid>`` is used instead (created 0700, its owner and mode checked: a folder planted there by
    another user is refused, never used).  Raises BadInput when the folder is unsafe.
    """
    import warnings

    from platformdirs import user_runtime_dir

    try:
        with warnings.catch_warnings():  # newer platformdirs warn when XDG_RUNTIME_DIR is unset: not news here
            warnings.simplefilter("ignore")
            cand = Path(user_runtime_dir("broker", appauthor=False))
        # only a parent the system made for this user (systemd's /run/user/<uid> is 0700): older platformdirs name
        # /run/user/<uid> even where it does not exist
        pst = os.lstat(cand.parent)
        usable = stat.S_ISDIR(pst.st_mode) and pst.st_uid == os.geteuid() and not pst.st_mode & 0o077
    except OSError:
        usable = False
    if usable and len(str(cand)) + 1 + socket_room <= SUN_PATH_MAX:
        return _make_checked(cand)
    from broker.core.config import broker_home

    home_run = broker_home() / "run"
    if len(str(home_run)) + 1 + socket_room <= SUN_PATH_MAX:
        return _make_checked(home_run)
    return _make_checked(SHORT_BASE / f"broker-{os.geteuid()}")


def machine_lock_dir() -> Path:
    """The folder (0700, checked) for locks that every broker home of this user on this machine must share (the
    netns provider's subnet choice: addresses are machine-wide, homes are not).  For root ``/run/broker`` (``/run``
    is root's alone: nothing can be planted there), else :func:`runtime_dir`.  Raises BadInput when unsafe."""
    run = Path("/run")
    if os.geteuid() == 0 and run.is_dir() and os.access(run, os.W_OK):
        return _make_checked(run / "broker")
    return runtime_dir()


def control_path(tag: str = "ssh") -> str:
    """An ssh ``ControlPath`` in :func:`runtime_dir` (``<dir>/<tag>-%C``): per user, 0700, short enough for a
    unix socket once ssh adds its temporary suffix.  Raises BadInput when the runtime folder is unsafe."""
    room = len(tag) + 1 + SSH_HASH_LEN + SSH_TEMP_SUFFIX
    return str(runtime_dir(socket_room=room) / f"{tag}-%C")


def open_lock(path: Path | str) -> int:
    """A file descriptor of the lock file ``path`` (created 0600, never through a symlink, only a regular file this
    user owns); for ``fcntl.flock``.  Raises OSError (ELOOP for a planted symlink) or BadInput for a file that is
    another user's."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise BadInput(f"lock file {path} is not a regular file of yours (owner uid {st.st_uid})",
                       hint=f"remove it (rm {path}) and run again")
    return fd


# --------------------------------------------------------------------------------------------------- env
#: credentials broker reads outside its settings (the tailnet key of ``--mesh tailscale``) and the cloud SDKs'
#: own variables for the clouds broker talks to (boto3: AWS_*, the OCI SDK: OCI_*, google-auth: GOOGLE_*)
_OTHER_CREDENTIAL_NAMES = frozenset({"TS_AUTHKEY", "TAILSCALE_AUTHKEY", "CONTAINER_API_KEY"})
_OTHER_CREDENTIAL_PREFIXES = ("GOOGLE_", "CLOUDSDK_", "VASTAI_")


def broker_secret_names() -> frozenset[str]:
    """Names of the secrets broker itself reads (upper case): every secret setting of
    :class:`broker.core.config.EnvSettings` (``VAST_API_KEY``, ``AWS_SECRET_ACCESS_KEY`` ...), the other credentials it
    keeps from local jobs (``TS_AUTHKEY`` ...), and every secret-looking name (:func:`looks_secret`) of a
    provider's settings family (``VAST_``, ``OCI_``, ``AWS_``, ``GOOGLE_`` ...).  A recipe's ``env:`` may not copy
    them to the nodes (a recipe is often someone else's); ``secrets:`` names one explicitly."""
    from dataclasses import fields

    from broker.core.config import EnvSettings, _env_name

    names, prefixes = set(_OTHER_CREDENTIAL_NAMES), set(_OTHER_CREDENTIAL_PREFIXES)
    for f in fields(EnvSettings):
        env = _env_name(f).upper()
        if "Secret" in str(f.type):
            names.add(env)
        if not env.startswith("BROKER_"):
            prefixes.add(env.split("_", 1)[0] + "_")
    return frozenset(names | {f"{p}*" for p in prefixes})


def is_broker_secret(name: str) -> bool:
    """Whether ``name`` is one of broker's own secrets (:func:`broker_secret_names`)."""
    n = name.upper()
    known = broker_secret_names()
    return n in known or (looks_secret(n) and any(p.endswith("*") and n.startswith(p[:-1]) for p in known))


def credential_names(environ: dict[str, str] | os._Environ) -> list[str]:
    """Names in ``environ`` a local job must not inherit: the cloud credentials and endpoints broker itself uses.

    Derived from :class:`broker.core.config.EnvSettings`: every setting that is a secret, and every variable of a
    provider's settings family (the prefix of its settings: ``VAST_``, ``OCI_``, ``AWS_``), plus
    ``TS_AUTHKEY`` and ``GOOGLE_*``.  ``BROKER_*`` settings are not credentials and stay.  Sorted.
    """
    from dataclasses import fields

    from broker.core.config import EnvSettings, _env_name

    names, prefixes = set(_OTHER_CREDENTIAL_NAMES), set(_OTHER_CREDENTIAL_PREFIXES)
    for f in fields(EnvSettings):
        env = _env_name(f).upper()
        if env.startswith("BROKER_"):
            continue
        if "Secret" in str(f.type):
            names.add(env)
        prefixes.add(env.split("_", 1)[0] + "_")
    return sorted(k for k in environ if k.upper() in names or k.upper().startswith(tuple(prefixes)))
