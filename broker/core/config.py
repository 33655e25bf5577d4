"""Settings and paths.

Keys come from the environment or a ``.env`` file in the current directory (every name is listed in
``.env.example``).  Where broker sends them and which ledger it obeys do not: endpoint overrides (``*_URL``,
``*ENDPOINT*``), hosts (``*_HOST``), other credential files and profiles (``*_CONFIG_FILE``, ``*_PROFILE``) and
``BROKER_HOME`` are read from the real environment only (:func:`env_only`), because a ``.env`` arrives with any
folder a user clones; one set in ``.env`` is ignored with a one-line notice on stderr.  Regions may come from
``.env`` but must have their provider's form (:func:`check_regions`).  An empty
value means "unset", in the environment and in ``.env``.  A non-loopback endpoint must be https
(:func:`check_endpoint`).  Values are never printed: the settings keep secrets as ``SecretStr`` / :class:`Secret`.  Nothing here is
built at import time: :func:`settings` reads the environment into :class:`EnvSettings` without importing pydantic
when there is no ``.env`` file (the common case of ``broker plan``; saves ~100 ms of start-up), and builds the
pydantic-settings model (which validates the file) only when there is one.

Paths: the broker home (ledger, run directories, watchdog lock) is ``$BROKER_HOME`` when set, else the user data
directory from platformdirs (``~/.local/share/broker`` on Linux).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.errors import BadInput

#: hosts an http:// endpoint may name (a local emulator or proxy); anything else must be https
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_endpoint(name: str) -> bool:
    """Whether setting ``name`` (any case) is an endpoint override (``*_URL``, ``*ENDPOINT*``): a URL broker sends
    the account's key to (checked by :func:`check_endpoint`)."""
    n = name.lower()
    return n.endswith("_url") or "endpoint" in n


def env_only(name: str) -> bool:
    """Whether setting ``name`` (a variable or field name, any case) may come from the real environment only: what
    names WHERE broker connects or WHOSE credentials it reads -- ``BROKER_HOME``, every endpoint override
    (:func:`is_endpoint`), every host (``*_HOST``: the Slurm login host receives the batch script with the
    secrets) and every pointer to another credentials file or profile (``*_CONFIG_FILE``, ``*_CREDENTIALS_FILE``,
    ``*_PROFILE``).  Regions may come from ``.env``: they are validated against their provider's form instead
    (:func:`check_regions`)."""
    n = name.lower()
    return (n == "broker_home" or is_endpoint(n) or n.endswith("_host")
            or n.endswith(("_config_file", "_credentials_file", "_profile")))


def is_loopback_host(host: str | None) -> bool:
    """``host`` (a name or an IP address, brackets allowed) is this machine: ``localhost``, 127.0.0.0/8 or ::1."""
    import ipaddress

    h = (host or "").strip("[]").lower()
    if h in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_endpoint(name: str, url: str) -> str:
    """``url`` of endpoint setting ``name`` when it is safe to send a key to: https, or http to a loopback host.
    Raises BadInput naming the variable and the fix otherwise (plain http elsewhere would carry the key in clear)."""
    from urllib.parse import urlsplit

    var = name.upper()
    try:
        u = urlsplit(url.strip())
        host = u.hostname
    except ValueError:
        u, host = None, None
    if u is None or u.scheme not in ("http", "https") or not host:
        raise BadInput(f"{var}={url!r} is not an http(s) URL",
                       hint=f"set {var} to a URL like https://host[:port] in the environment, or unset it")
    if u.scheme == "http" and not is_loopback_host(host):
        raise BadInput(f"{var}={url} is plain http to {host}, which is not this machine: broker would send the "
                       "account's key there in clear",
                       hint=f"use https://{u.netloc}{u.path} (or an http:// endpoint on 127.0.0.1 / localhost), or "
                            f"unset {var}")
    return url

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings as Settings


class Secret:
    """A secret setting read from the environment: :meth:`get_secret_value` gives it; ``str``/``repr`` show
    ``**********`` only (as pydantic's ``SecretStr``, which the ``.env`` path gives)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __str__(self) -> str:
        return "**********" if self._value else ""

    def __repr__(self) -> str:
        return f"Secret('{self}')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def _env(name: str, **meta: Any) -> Any:
    """``field`` metadata: the setting is read from the environment variable ``name`` (not its own name)."""
    return field(default=None, metadata={"env": name, **meta})


def _region() -> Any:
    """``field`` metadata: the setting is a region of the provider its name starts with (``<provider>_region``,
    validated by :func:`check_regions` against that adapter's form)."""
    return field(default=None, metadata={"region": True})


@dataclass(frozen=True)
class EnvSettings:
    """Every setting broker reads; names are the environment variables (case-insensitive) unless the field's
    metadata names another (``AWS_DEFAULT_REGION``).  This is the one list of settings: :func:`settings` fills it
    from the environment without pydantic when there is no ``.env`` file; :func:`_fields_class` builds the pydantic
    model (``.env`` files, through pydantic-settings) from it."""

    broker_home: Path | None = None

    # Vast.ai: key also read from the vastai CLI's key files (see providers.vast).
    vast_api_key: Secret | None = None
    vast_api_url: str = "https://console.vast.ai"

    # OCI: ~/.oci/config and profile; endpoint override for proxies / emulators (tests).
    oci_config_file: str = "~/.oci/config"
    oci_profile: str = "DEFAULT"
    oci_compartment_id: str | None = None
    oci_region: str | None = _region()
    oci_service_endpoint: str | None = None  # base URL for every OCI client (tests)
    oci_image_id: str | None = None
    oci_subnet_id: str | None = None
    # Arm the OCI node-side dead-man switch (needs a dynamic group + policy: providers.oci.INSTANCE_PRINCIPAL_SETUP)
    oci_instance_principal: bool = False

    # AWS: the boto3 credential chain is used as is; these are optional overrides (read from .env too, where
    # boto3 would not see them): keys, profile, and the region (AWS_DEFAULT_REGION, else the profile's, else
    # AWS_REGION: boto3's own order, then the other SDKs' variable)
    aws_access_key_id: Secret | None = None
    aws_secret_access_key: Secret | None = None
    aws_session_token: Secret | None = None
    aws_profile: str | None = None
    aws_region: str | None = _env("AWS_DEFAULT_REGION", region=True)
    aws_region_alt: str | None = _env("AWS_REGION", region=True)
    aws_endpoint_url: str | None = None
    aws_ami_id: str | None = None
    aws_subnet_id: str | None = None  # launch into this subnet's VPC instead of the default VPC

    # Slurm (--provider slurm): login node for ssh (default: Slurm commands on this machine), the Python with
    # torch on the compute nodes, and the partition / account to submit to (default: the cluster's)
    broker_slurm_host: str | None = None
    broker_slurm_python: str = "python3"
    broker_slurm_partition: str | None = None
    broker_slurm_account: str | None = None

    # Watchdog (seconds between rounds; `broker run` on rented machines starts it detached)
    broker_watchdog_interval_s: float = 5.0
    broker_watchdog_autostart: bool = True


_TRUE = ("1", "on", "t", "true", "y", "yes")
_FALSE = ("0", "off", "f", "false", "n", "no")


def _parse(name: str, kind: str, text: str) -> Any:
    """``text`` of environment variable ``name`` as a value of ``kind`` (the field's annotation), read as
    pydantic reads it.  Raises BadInput naming the variable."""
    base = kind.removesuffix(" | None")
    if base == "str":
        return text
    if base == "Secret":
        return Secret(text)
    if base == "Path":
        return Path(text)
    if base == "bool":
        t = text.strip().lower()
        if t in _TRUE or t in _FALSE:
            return t in _TRUE
        raise BadInput(f"{name.upper()}={text!r} is not true or false", hint="use true/false (or 1/0, yes/no, on/off)")
    if base == "float":
        try:
            return float(text)
        except ValueError:
            raise BadInput(f"{name.upper()}={text!r} is not a number", hint="e.g. 5 or 2.5") from None
    raise TypeError(f"EnvSettings.{name}: no reader for {kind!r}")


def _env_name(f: Any) -> str:
    return f.metadata.get("env", f.name)


@lru_cache(maxsize=1)
def _fields_class() -> type:
    """Every setting of :class:`EnvSettings` as a pydantic model (the base of the ``.env`` settings): the same names,
    defaults and environment aliases; secrets as ``SecretStr``."""
    from pydantic import ConfigDict, Field, SecretStr, create_model

    types = {"str": str, "Secret": SecretStr, "Path": Path, "bool": bool, "float": float}
    spec: dict[str, Any] = {}
    for f in fields(EnvSettings):
        base = f.type.removesuffix(" | None")
        t = types[base] if base == f.type else (types[base] | None)
        alias = f.metadata.get("env")
        spec[f.name] = (t, Field(default=f.default, validation_alias=alias) if alias else f.default)
    return create_model("SettingsFields", __config__=ConfigDict(extra="ignore"), **spec)


@lru_cache(maxsize=1)
def _settings_class() -> type:
    """The pydantic-settings model (environment + ``.env``), built on first use: pydantic-settings is imported only
    when a ``.env`` file has to be read.  The ``.env`` source drops :func:`env_only` settings; empty values are
    unset in both sources."""
    from pydantic_settings import BaseSettings, DotEnvSettingsSource, SettingsConfigDict

    class KeysOnlyDotEnv(DotEnvSettingsSource):
        def _load_env_vars(self) -> Any:
            return {k: v for k, v in super()._load_env_vars().items() if not env_only(k)}

    class Settings(BaseSettings, _fields_class()):
        model_config = SettingsConfigDict(env_file=".env", env_file_encoding="utf-8", extra="ignore",
                                          env_ignore_empty=True)

        @classmethod
        def settings_customise_sources(cls, settings_cls: Any, init_settings: Any, env_settings: Any,
                                       dotenv_settings: Any, file_secret_settings: Any) -> tuple:
            return init_settings, env_settings, KeysOnlyDotEnv(settings_cls), file_secret_settings

    return Settings


def __getattr__(name: str) -> Any:  # ``from broker.core.config import Settings`` still works (built lazily)
    if name == "Settings":
        return _settings_class()
    raise AttributeError(f"module 'broker.core.config' has no attribute {name!r}")


def _from_environment() -> EnvSettings:
    """The settings from the environment alone, as pydantic-settings reads them (case-insensitive names, the
    ``AWS_DEFAULT_REGION`` / ``AWS_REGION`` aliases), without importing pydantic: the fast path when there is no
    ``.env`` file.  Raises BadInput for a malformed value (a flag that is not true/false, a number that is not)."""
    env = {k.lower(): v for k, v in os.environ.items() if v.strip()}  # empty = unset, as env_ignore_empty
    data = {}
    for f in fields(EnvSettings):
        key = _env_name(f).lower()
        if key in env:
            data[f.name] = _parse(key, f.type, env[key])
    return EnvSettings(**data)


#: (``.env`` path, variable) pairs already reported by :func:`_dotenv_notice` in this process
_NOTICED: set[tuple[str, str]] = set()


def _dotenv_notice() -> None:
    """One line on stderr when ``./.env`` sets (non-empty) a setting that only the real environment may set
    (:func:`env_only`): the value is ignored, and the line names the file, the variables and the fix.  Once per
    file and variable in a process.  Never raises (an unreadable ``.env`` is pydantic-settings' to report)."""
    p = Path(".env")
    if not p.is_file():
        return
    try:
        from dotenv import dotenv_values

        names = [k for k, v in dotenv_values(p, encoding="utf-8").items() if env_only(k) and (v or "").strip()]
    except Exception:  # noqa: BLE001 - a notice must not break a command
        return
    where = str(p.resolve())
    names = [n for n in names if (where, n.upper()) not in _NOTICED]
    if not names:
        return
    _NOTICED.update((where, n.upper()) for n in names)
    import sys

    sys.stderr.write(f"broker: ignoring {', '.join(n.upper() for n in names)} in {where}: endpoints, hosts, "
                     "credential files/profiles and the broker home come from the real environment only (export "
                     f"{names[0].upper()}=... in your shell to use it)\n")


def check_region(provider: Any, name: str, region: str) -> str:
    """``region`` of setting ``name`` when it has ``provider``'s region form (the adapter class's
    :meth:`~broker.core.provider.Provider.valid_region`); raises BadInput naming the variable, the form and the fix
    otherwise.  A region becomes part of the SDK's host name (``iaas.<region>.oraclecloud.com``): a value such as
    ``attacker.example`` would send the signed requests elsewhere."""
    r = region.strip()
    if not provider.valid_region(r):
        var = name.upper()
        raise BadInput(f"{var}={region!r} is not a {provider.name} region name ({provider.region_form()}): the "
                       "SDK would build the provider's endpoint from it",
                       hint=f"set {var} to a region name such as {provider.region_example()} (in the environment or "
                            ".env), or unset it to use the profile's region")
    return r


def check_regions(s: Any) -> Any:
    """Settings ``s`` after checking every region setting (metadata ``region``; the provider is the first word of
    the field's name) that is set against its provider's form (:func:`check_region`).  The adapter class is
    imported only for a region that is set."""
    for f in fields(EnvSettings):
        prov = f.name.split("_", 1)[0] if f.metadata.get("region") else None
        v = getattr(s, f.name, None)
        if prov and isinstance(v, str) and v.strip():
            from broker.providers import provider_class

            check_region(provider_class(prov), _env_name(f), v)
    return s


def _check_endpoints(s: Any) -> Any:
    for f in fields(EnvSettings):
        v = getattr(s, f.name, None)
        if is_endpoint(_env_name(f)) and isinstance(v, str) and v.strip():
            check_endpoint(_env_name(f), v)
    return check_regions(s)


@lru_cache(maxsize=1)
def settings() -> "Settings | EnvSettings":
    """The process-wide settings (read once): the environment, then ``.env`` in the current directory for what it
    may set (keys, not :func:`env_only` settings: those in it are ignored with a notice).  Without a ``.env`` file
    they are an :class:`EnvSettings` (no pydantic import: ``broker plan`` reads them); with one, the
    pydantic-settings model of the same fields.  Raises BadInput for a malformed value or an endpoint that is
    plain http to another machine (:func:`check_endpoint`)."""
    if Path(".env").exists():
        _dotenv_notice()
        return _check_endpoints(_settings_class()())
    return _check_endpoints(_from_environment())


def home_path() -> Path:
    """Where the broker home is (``$BROKER_HOME`` from the real environment, else the platform's user data folder),
    without creating it.  A ``BROKER_HOME`` in ``.env`` is ignored (with a notice): a cloned folder must not point
    broker at another ledger."""
    env = os.environ.get("BROKER_HOME", "").strip()
    if env:
        return Path(env).expanduser()
    _dotenv_notice()
    from platformdirs import user_data_dir

    return Path(user_data_dir("broker", appauthor=False))


def _home_error(home: Path, what: str, e: OSError | None = None) -> BadInput:
    why = f": {e.strerror or e}" if e is not None else ""
    src = "BROKER_HOME" if os.environ.get("BROKER_HOME", "").strip() else "the broker home"
    return BadInput(f"{src} {home} {what}{why}",
                    hint="set BROKER_HOME to a folder you can write (it holds the ledger and run logs), e.g. "
                         "export BROKER_HOME=~/.local/share/broker")


def ensure_dir(d: Path, home: Path | None = None) -> Path:
    """Create folder ``d`` (under the broker home) 0700 and check it is writable; BadInput (exit 2) naming the folder
    and the fix otherwise (read-only file system, a file in the way, no permission)."""
    home = home or d
    from broker.core.fsmode import private_dir, tighten_dir

    try:
        existed = d.is_dir()
        private_dir(d)  # 0700 from its creation, under any umask: the ledger and run logs are the user's alone
        if existed and (d != home or (d / "ledger.sqlite").exists()):
            tighten_dir(d)  # a home / runs folder an older broker made 0755 (never a folder that is not broker's)
    except FileExistsError as e:  # a file (or a dangling link) where the folder should be
        raise _home_error(home, "is not a folder" if d == home else f"cannot hold {d.name}/ (a file is in the way)",
                          e) from None
    except OSError as e:
        raise _home_error(home, "cannot be created" if d == home else f"cannot hold {d.name}/", e) from None
    if not d.is_dir():
        raise _home_error(home, "is not a folder")
    if not os.access(d, os.W_OK):  # read-only file system (EROFS even for root) or no permission
        raise _home_error(home, "is not writable")
    return d


def broker_home() -> Path:
    """Directory for the ledger and run directories; created on first use.  BadInput when unusable."""
    home = home_path()
    return ensure_dir(home)


def runs_dir() -> Path:
    """Parent of every run directory (``<home>/runs/<run_id>``)."""
    home = broker_home()
    return ensure_dir(home / "runs", home)


def ledger_path() -> Path:
    """The SQLite ledger file."""
    return broker_home() / "ledger.sqlite"
