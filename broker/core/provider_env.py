"""The provider settings a run was made with, so that a watchdog started by another CLI serves it too.

A run is recorded with ``<run dir>/provider_env.json`` (0600): its non-secret provider settings (every variable of a
provider's settings family that is not a secret: endpoints, profiles, regions, config and credentials *file paths*,
e.g. ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``OCI_CONFIG_FILE``, ``GOOGLE_APPLICATION_CREDENTIALS``), the *names*
of the secrets it had in its environment, and a keyed digest of their values (HMAC-SHA256 with a per-home key,
``<home>/.provider-env-key``): never a secret value.

A watchdog serves a run whose settings differ from its own by applying the run's settings (:func:`applied`) while
it handles that run: credentials then resolve the way the run's did (its profile, its files).  A run whose secrets
were only in its CLI's environment, and differ from the watchdog's, cannot be served that way
(:func:`servable` False): its CLI starts a watchdog of its own for it (:func:`broker.money.watchdog.start_detached`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

FILE = "provider_env.json"


def _is_secret(name: str) -> bool:
    from broker.core.private import is_broker_secret, looks_secret

    return is_broker_secret(name) or looks_secret(name)


def _family(environ: Mapping[str, str]) -> list[str]:
    from broker.core.private import credential_names

    return credential_names(dict(environ))


def _key(home: Path | None) -> bytes:
    """The per-home digest key (32 random bytes, created 0600 on first use)."""
    from broker.core.config import home_path
    from broker.core.private import write_private

    p = Path(home or home_path()) / ".provider-env-key"
    try:
        data = p.read_bytes()
        if len(data) >= 32:
            return data
    except OSError:
        pass
    data = os.urandom(32)
    try:
        write_private(p, data)
    except OSError:
        pass
    return data


def capture(environ: Mapping[str, str] | None = None, *, home: Path | None = None) -> dict[str, Any]:
    """This process's provider settings: ``settings`` (non-secret name -> value), ``secrets`` (names) and
    ``secrets_digest`` (keyed digest of their values, "" when none)."""
    env = dict(os.environ if environ is None else environ)
    if environ is None:
        env.update(_dotenv_secrets(env))
    names = _family(env)
    settings = {n: env[n] for n in names if not _is_secret(n) and env[n].strip()}
    secrets = sorted(n for n in names if _is_secret(n) and env[n].strip())
    digest = ""
    if secrets:
        blob = json.dumps({n: env[n] for n in secrets}, sort_keys=True).encode()
        digest = hmac.new(_key(home), blob, hashlib.sha256).hexdigest()
    return {"settings": dict(sorted(settings.items())), "secrets": secrets, "secrets_digest": digest}


def _dotenv_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """The secrets this process's settings hold that its environment does not (keys from a ``.env`` file): they
    are part of what the run's credentials were, so of the digest."""
    out: dict[str, str] = {}
    try:
        from dataclasses import fields

        from broker.core.config import EnvSettings, _env_name, settings

        s = settings()
        for f in fields(EnvSettings):
            name = _env_name(f).upper()
            v = getattr(s, f.name, None)
            if "Secret" in str(f.type) and v is not None and name not in env:
                val = v.get_secret_value() if hasattr(v, "get_secret_value") else str(v)
                if val:
                    out[name] = val
    except Exception:  # noqa: BLE001 - settings that cannot be read: the environment alone
        return {}
    return out


def fingerprint(env: Mapping[str, Any]) -> str:
    """A short id of a captured environment (equal settings and secrets give equal ids)."""
    blob = json.dumps({"s": env.get("settings") or {}, "d": env.get("secrets_digest") or ""}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def record(run_dir: Path | str, environ: Mapping[str, str] | None = None, *, home: Path | None = None) -> None:
    """Write ``<run_dir>/provider_env.json`` (0600) for this process (or ``environ``); best effort."""
    from broker.core.private import write_private

    try:
        write_private(Path(run_dir) / FILE, json.dumps(capture(environ, home=home), indent=2))
    except OSError:
        pass


def read(run_dir: Path | str | None) -> dict[str, Any] | None:
    """The run's recorded settings, or None when there are none or they are not what broker writes (a name outside
    the provider families, a secret's value, an endpoint that is not https or loopback: refused, never applied)."""
    if not run_dir:
        return None
    try:
        data = json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    settings, secrets, digest = data.get("settings"), data.get("secrets"), data.get("secrets_digest")
    if not (isinstance(settings, dict) and isinstance(secrets, list) and isinstance(digest, str)):
        return None
    from broker.core.config import check_endpoint, is_endpoint

    if any(not isinstance(k, str) or not isinstance(v, str) or "\0" in v for k, v in settings.items()):
        return None
    if set(_family({k: "x" for k in settings})) != set(settings) or any(_is_secret(k) for k in settings):
        return None
    try:
        for k, v in settings.items():
            if is_endpoint(k):
                check_endpoint(k, v)
    except Exception:  # noqa: BLE001 - an endpoint broker would not send a key to: refused
        return None
    if not all(isinstance(n, str) for n in secrets):
        return None
    return {"settings": settings, "secrets": sorted(secrets), "secrets_digest": digest}


def servable(run_env: Mapping[str, Any], own: Mapping[str, Any]) -> bool:
    """Whether a process with environment ``own`` (captured) can act for a run made with ``run_env``: the run had
    no secret in its environment (its credentials come from its profile / files, named in its settings), or the
    same secrets as ``own``."""
    return not run_env.get("secrets") or run_env.get("secrets_digest") == own.get("secrets_digest")


@contextlib.contextmanager
def applied(run_env: Mapping[str, Any]) -> Iterator[None]:
    """While inside: this process's provider settings are the run's (its non-secret settings set, the others of
    the families unset; this process's secrets kept only when the run used the same ones) and the settings cache
    is cleared on the way in and out.  Single-threaded use only (the environment is the process's)."""
    from broker.core.config import settings

    saved = dict(os.environ)
    own_secrets_used = bool(run_env.get("secrets"))
    try:
        for n in _family(os.environ):
            if not _is_secret(n) or not own_secrets_used:
                os.environ.pop(n, None)
        os.environ.update(run_env.get("settings") or {})
        settings.cache_clear()
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        settings.cache_clear()
