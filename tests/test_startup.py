"""Start-up hygiene: `broker --help` loads no pydantic / rich help styling, errors are pydantic-free, and settings
are read without pydantic-settings unless a .env file needs it (bench/cli_startup.py measures the times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def modules_after(code: str, cwd: Path, env: dict | None = None) -> set[str]:
    prog = code + "\nimport json, sys; sys.stderr.write('MODS=' + json.dumps(sorted(sys.modules)) + '\\n')"
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    cp = subprocess.run([sys.executable, "-c", prog], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)
    line = [ln for ln in cp.stderr.splitlines() if ln.startswith("MODS=")]
    assert line, cp.stdout + cp.stderr
    return set(json.loads(line[-1][5:]))


def test_help_imports_no_pydantic_or_rich_help(tmp_path):
    mods = modules_after("import sys\nfrom broker import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h")})
    for heavy in ("pydantic", "pydantic_settings", "typer.rich_utils", "rich.markdown", "rich.console", "yaml",
                  "httpx", "asyncssh"):
        assert heavy not in mods, heavy


def test_errors_module_is_pydantic_free(tmp_path):
    mods = modules_after("import broker.errors, broker.limits, broker.config", tmp_path)
    assert "pydantic" not in mods and "typer" not in mods


def test_plan_reads_settings_without_pydantic_settings(tmp_path):
    mods = modules_after("from broker.config import settings\ns = settings()\nassert s.vast_api_key is None",
                         tmp_path, {"BROKER_HOME": str(tmp_path / "h")})
    assert "pydantic_settings" not in mods
    (tmp_path / ".env").write_text("VAST_API_URL=http://127.0.0.1:9\n")
    mods = modules_after("from broker.config import settings\nassert settings().vast_api_url == 'http://127.0.0.1:9'",
                         tmp_path)
    assert "pydantic_settings" in mods


ENV = {"VAST_API_KEY": "k-123", "vast_api_url": "http://x", "OCI_INSTANCE_PRINCIPAL": "1",
       "AWS_DEFAULT_REGION": "eu-west-1", "BROKER_WATCHDOG_INTERVAL_S": "2.5", "BROKER_WATCHDOG_AUTOSTART": "false",
       "BROKER_SLURM_HOST": "me@login", "BROKER_HOME": "/tmp/somewhere"}


def test_environment_fast_path_matches_pydantic_settings(tmp_path, monkeypatch):
    from broker import config

    monkeypatch.chdir(tmp_path)  # no .env here
    for k in list(os.environ):
        if k.upper() in {n.upper() for n in ENV} or k.upper().startswith(("VAST_", "OCI_", "BROKER_")):
            monkeypatch.delenv(k, raising=False)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    fast = config._from_environment()
    full = config._settings_class()()
    a, b = fast.model_dump(), full.model_dump()
    a["vast_api_key"] = a["vast_api_key"].get_secret_value()
    b["vast_api_key"] = b["vast_api_key"].get_secret_value()
    assert a == b
    assert fast.aws_region == "eu-west-1" and fast.oci_instance_principal is True
    assert fast.broker_watchdog_autostart is False and fast.broker_watchdog_interval_s == 2.5
    assert set(config._fields_class().model_fields) == set(config._settings_class().model_fields)


def test_settings_class_still_importable():
    from broker.config import Settings

    assert "vast_api_key" in Settings.model_fields
    with pytest.raises(ImportError):
        from broker.config import NoSuchThing  # noqa: F401


def test_plan_does_not_coerce_options_through_pydantic_adapters(tmp_path):
    """typer 0.29 builds a pydantic TypeAdapter for every CLI parameter on every start (+120 ms for ``broker plan``,
    bench/cli_startup.py); pyproject pins ``typer<0.29``."""
    mods = modules_after("from broker import cli\ntry:\n    cli.main(['plan', '--budget', '5'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"})
    assert "typer._adapters" not in mods


def test_value_types_build_their_schema_on_first_use():
    """Importing broker.model builds no schema (``defer_build``): a command pays only for the models it uses."""
    code = ("import broker.model as m\nassert not any(c.__pydantic_complete__ for c in (m.Offer, m.Run, m.Cluster))\n"
            "m.Requirements(budget_usd=None)\nassert m.Requirements.__pydantic_complete__\n"
            "assert not m.Run.__pydantic_complete__")
    cp = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
