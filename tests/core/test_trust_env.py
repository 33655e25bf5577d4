"""A folder's `.env` may supply keys, never endpoints or the broker home (trust boundaries).

The `.env` of a cloned folder is input: an endpoint in it (VAST_API_URL, OCI_SERVICE_ENDPOINT, AWS_ENDPOINT_URL)
must not receive the account's key, a BROKER_HOME in it must not point broker at another ledger, and the shipped
`.env.example` copied to `.env` must change nothing.  An endpoint in the real environment must be https unless it
is this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, broker_cmd

KEY = "vast-key-not-real-0123456789"


def _run(args, cwd, env, timeout=60):
    return subprocess.run(broker_cmd(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "cloned"
    d.mkdir()
    return d


def test_dotenv_endpoint_never_gets_the_key(folder, cli_env, own_httpserver):
    """The exact case: `VAST_API_URL=http://127.0.0.1:PORT` in a `.env` made `broker offers --provider vast` send
    `Authorization: Bearer <key>` there.  The endpoint is ignored (one line on stderr names file and variable);
    the request goes to the default endpoint, which here is a proxy sink on loopback so nothing leaves the box."""
    from pytest_httpserver import HTTPServer

    sink = HTTPServer(host="127.0.0.1", port=0)  # HTTPS_PROXY: where a request to the real default would go
    sink.start()
    try:
        (folder / ".env").write_text(f"VAST_API_KEY={KEY}\nVAST_API_URL={own_httpserver.url_for('/').rstrip('/')}\n")
        env = dict(cli_env, HTTPS_PROXY=sink.url_for("/").rstrip("/"), NO_PROXY="")
        env.pop("VAST_API_URL", None)
        r = _run(["offers", "--provider", "vast"], folder, env)
        assert own_httpserver.log == [], [req.headers.get("Authorization") for req, _ in own_httpserver.log]
        assert any("console.vast.ai" in req.url or req.method == "CONNECT" for req, _ in sink.log)  # the default
        notice = [ln for ln in r.stderr.splitlines() if ln.startswith("broker: ignoring")]
        assert len(notice) == 1 and "VAST_API_URL" in notice[0] and str(folder / ".env") in notice[0] and "ignoring" in notice[0], r.stderr
        assert KEY not in r.stderr + r.stdout
    finally:
        sink.clear()
        sink.stop()


@pytest.mark.parametrize("var", ["VAST_API_URL", "OCI_SERVICE_ENDPOINT", "AWS_ENDPOINT_URL", "BROKER_HOME"])
def test_every_env_only_setting_is_ignored_in_dotenv(var, folder, monkeypatch):
    from broker.core import config
    monkeypatch.chdir(folder)
    for v in ("VAST_API_URL", "OCI_SERVICE_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(v, raising=False)
    baseline = config._from_environment()
    (folder / ".env").write_text(f"{var}=http://127.0.0.1:1/evil\nVAST_API_KEY=from-dotenv\n")
    config.settings.cache_clear()
    s = config.settings()
    assert getattr(s, var.lower()) == getattr(baseline, var.lower())
    assert s.vast_api_key.get_secret_value() == "from-dotenv"  # keys still come from .env


def test_env_only_names_the_class():
    from broker.core.config import env_only

    assert all(env_only(n) for n in ("BROKER_HOME", "VAST_API_URL", "OCI_SERVICE_ENDPOINT", "AWS_ENDPOINT_URL",
                                     "oci_service_endpoint", "FOO_API_URL", "X_ENDPOINT_OVERRIDE"))
    # hosts and pointers to other credentials are where broker connects / whose key it uses: environment only
    assert all(env_only(n) for n in ("BROKER_SLURM_HOST", "OCI_PROFILE", "AWS_PROFILE", "OCI_CONFIG_FILE"))
    # regions may come from .env: they are validated against their provider's form instead
    assert not any(env_only(n) for n in ("VAST_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "OCI_REGION"))


def _home_env(cli_env, tmp_path):
    env = dict(cli_env, HOME=str(tmp_path / "user"), XDG_DATA_HOME=str(tmp_path / "user" / "data"))
    env.pop("BROKER_HOME", None)
    return env


def test_broker_home_in_dotenv_is_ignored_with_one_line(folder, cli_env, tmp_path):
    env = _home_env(cli_env, tmp_path)
    other = tmp_path / "attacker-ledger"
    (folder / ".env").write_text(f"BROKER_HOME={other}\n")
    r = _run(["status", "--json"], folder, env)
    assert r.returncode == 0, r.stderr
    assert not other.exists()
    assert (tmp_path / "user" / "data" / "broker" / "ledger.sqlite").exists()
    lines = [ln for ln in r.stderr.splitlines() if "BROKER_HOME" in ln]
    assert len(lines) == 1 and lines[0].startswith("broker: ignoring BROKER_HOME") and str(folder / ".env") in lines[0], r.stderr


def _seed_billing(home: Path) -> None:
    """A live billing instance in the ledger under ``home`` (a real SQLite file)."""
    from datetime import timedelta

    from broker.money.ledger import Ledger
    from broker.core.model import utcnow
    from broker.core.records import Run

    led = Ledger(home / "ledger.sqlite")
    now = utcnow()
    led.create_run(Run(id="run-bill", name="billing", provider="vast", status="running", created_at=now,
                       deadline=now + timedelta(hours=1)))
    rid = led.record_intent("run-bill", "vast", "instance", "broker-run-bill-n0", usd_per_hour=2.0).id
    led.mark_created(rid, "31337", state="running")
    led.close()


def test_env_example_copied_as_dotenv_changes_nothing(folder, cli_env, tmp_path):
    """The shipped `.env.example` copied to `.env` (as its first line invites): same home, same settings, and
    `broker status` still shows the instance that bills (it said "nothing is billing": BROKER_HOME= was the cwd)."""
    env = _home_env(cli_env, tmp_path)
    home = tmp_path / "user" / "data" / "broker"
    home.mkdir(parents=True)
    _seed_billing(home)
    before = _run(["status", "--json"], folder, env)
    shutil.copy(REPO / ".env.example", folder / ".env")
    after = _run(["status", "--json"], folder, env)
    assert before.returncode == after.returncode == 0, after.stderr
    b, a = json.loads(before.stdout), json.loads(after.stdout)
    assert [r["id"] for r in b["runs"]] == [r["id"] for r in a["runs"]] == ["run-bill"]
    assert [(x["provider_id"], x["state"]) for x in b["live_resources"]] == \
        [(x["provider_id"], x["state"]) for x in a["live_resources"]] == [("31337", "running")]
    assert b["totals"]["usd_per_hour"] == a["totals"]["usd_per_hour"] > 0
    text = _run(["status"], folder, env)
    assert "nothing is billing" not in text.stdout and "run-bill" in text.stdout
    assert "31337" in after.stdout
    assert not (folder / "ledger.sqlite").exists() and not (folder / "runs").exists()
    assert "ignoring" not in after.stderr  # nothing in the example is set, so nothing to report


def test_env_example_settings_equal_the_defaults(folder, monkeypatch):
    from broker.core import config
    monkeypatch.chdir(folder)
    for k in list(os.environ):
        if k.upper().startswith(("VAST_", "OCI_", "AWS_", "BROKER_")):
            monkeypatch.delenv(k, raising=False)
    config.settings.cache_clear()
    bare = config.settings()
    shutil.copy(REPO / ".env.example", folder / ".env")
    config.settings.cache_clear()
    with_example = config.settings()
    assert type(with_example) is not type(bare)  # the pydantic path really read the file
    for f in config.fields(config.EnvSettings):
        assert getattr(with_example, f.name) == getattr(bare, f.name), f.name


def test_empty_value_means_unset(folder, monkeypatch):
    from broker.core import config
    monkeypatch.chdir(folder)
    monkeypatch.setenv("VAST_API_URL", "")
    monkeypatch.setenv("BROKER_WATCHDOG_INTERVAL_S", "")
    config.settings.cache_clear()
    s = config.settings()
    assert s.vast_api_url == "https://console.vast.ai" and s.broker_watchdog_interval_s == 5.0
    (folder / ".env").write_text("OCI_PROFILE=\nBROKER_WATCHDOG_AUTOSTART=\n")
    monkeypatch.delenv("BROKER_WATCHDOG_AUTOSTART", raising=False)
    config.settings.cache_clear()
    s = config.settings()
    assert s.oci_profile == "DEFAULT" and s.broker_watchdog_autostart is True
    monkeypatch.setenv("BROKER_HOME", "")
    assert config.home_path() != Path(".")


@pytest.mark.parametrize("var", ["VAST_API_URL", "OCI_SERVICE_ENDPOINT", "AWS_ENDPOINT_URL"])
def test_plain_http_endpoint_to_another_machine_is_refused(var, folder, monkeypatch):
    from broker.core import config
    from broker.core.errors import BadInput

    monkeypatch.chdir(folder)
    monkeypatch.setenv(var, "http://198.18.0.9:8080")
    config.settings.cache_clear()
    with pytest.raises(BadInput) as e:
        config.settings()
    assert var in e.value.message and "https://198.18.0.9:8080" in (e.value.hint or "")


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "http://localhost:9", "http://[::1]:9",
                                 "https://proxy.example:8443"])
def test_loopback_http_and_https_endpoints_are_accepted(url, folder, monkeypatch):
    from broker.core import config
    monkeypatch.chdir(folder)
    monkeypatch.setenv("VAST_API_URL", url)
    config.settings.cache_clear()
    assert config.settings().vast_api_url == url


def test_plain_http_endpoint_refused_by_the_cli(folder, cli_env, own_httpserver):
    env = dict(cli_env, VAST_API_KEY=KEY, VAST_API_URL="http://198.18.0.9:8080")
    r = _run(["offers", "--provider", "vast"], folder, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "VAST_API_URL" in r.stderr and "https" in r.stderr and KEY not in r.stderr
