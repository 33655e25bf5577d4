"""A provider that is not configured stops `broker run` with exit 4 and one message that names the real cause
(client library missing, credentials missing, project missing), as `broker check` does, and the whole fix: the
install command worded for how broker was installed (a checkout's own pip, `-e '.[gcp]'`), then the credential
and project steps.  Run through `python -m broker` in a subprocess, as a user meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CLOUD_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "VAST_API_KEY", "OCI_CONFIG_FILE",
              "OCI_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG",
              "CLOUDSDK_CORE_PROJECT", "GCLOUD_PROJECT")


@pytest.fixture
def bare_env(cli_env, tmp_path) -> dict[str, str]:
    """No cloud credentials anywhere: an empty HOME, no key variables, no AWS/OCI files."""
    env = {k: v for k, v in cli_env.items() if k not in CLOUD_VARS}
    home = tmp_path / "home"
    home.mkdir()
    env.update(HOME=str(home), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), OCI_CONFIG_FILE=str(tmp_path / "none"))
    return env


def without_google_clients(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """``env`` where ``google.auth`` cannot be found: a plain ``google`` package first on the path hides the
    installed ``google`` namespace, as on a machine where the gcp extra was never installed."""
    shadow = tmp_path / "shadow"
    (shadow / "google").mkdir(parents=True)
    (shadow / "google" / "__init__.py").write_text("")
    return {**env, "PYTHONPATH": str(shadow) + os.pathsep + env["PYTHONPATH"]}


def broker(env: dict[str, str], *args: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    return p.returncode, " ".join(out.split())


def test_gcp_without_clients_says_they_are_missing_and_gives_every_step(bare_env, tmp_path):
    env = without_google_clients(bare_env, tmp_path)
    code, text = broker(env, "run", "--provider", "gcp", "recipes/ddp_2node.yaml")
    assert code == 4, text
    assert "gcp is not configured (the Google Cloud clients are not installed)" in text, text
    assert "no credentials" not in text, text
    # this checkout's own environment, not the package index's unrelated "broker"
    assert "pip install -e '.[gcp]'" in text and "pip install 'broker[gcp]'" not in text, text
    after = text.split("install -e '.[gcp]'", 1)[1]
    assert "gcloud auth application-default login" in after and "GOOGLE_APPLICATION_CREDENTIALS" in after, text
    assert "GOOGLE_CLOUD_PROJECT" in after, text
    # `broker check` says the same cause and the same fix (one check, not two)
    code, check = broker(env, "check", "--provider", "gcp")
    assert code == 0 and "the Google Cloud clients are not installed" in check, check
    hint = check.split("-> ", 1)[1]
    assert hint in text, (hint, text)


def test_gcp_without_credentials_gives_the_credential_steps(bare_env):
    code, text = broker(bare_env, "run", "--provider", "gcp", "recipes/ddp_2node.yaml")
    assert code == 4, text
    assert "gcp is not configured (no GOOGLE_APPLICATION_CREDENTIALS and no ADC file" in text, text
    assert "gcloud auth application-default login" in text and "GOOGLE_CLOUD_PROJECT" in text, text
    assert "pip install" not in text, text


def test_gcp_without_project_says_the_project_is_missing(bare_env, tmp_path):
    adc = tmp_path / "key.json"  # an authorized-user ADC file (what `gcloud auth application-default login` writes)
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "id.apps.googleusercontent.com",
                               "client_secret": "s", "refresh_token": "r"}))
    env = {**bare_env, "GOOGLE_APPLICATION_CREDENTIALS": str(adc)}
    code, text = broker(env, "run", "--provider", "gcp", "recipes/ddp_2node.yaml")
    assert code == 4, text
    assert "no project)" in text and "export GOOGLE_CLOUD_PROJECT=" in text, text


def test_interruptible_true_says_this_machine_is_never_interruptible(bare_env):
    code, text = broker(bare_env, "run", "recipes/ddp_spot.yaml")
    assert code == 4, text
    assert "this machine is never interruptible, so `interruptible: true` rules it out" in text, text
    assert "`--interruptible false` or `--provider local` runs it here" in text, text
    assert "gcp (no GOOGLE_APPLICATION_CREDENTIALS and no ADC file" in text, text  # each provider's cause, then fix
    # a recipe that accepts this machine gets no such clause
    code, text = broker(bare_env, "run", "--provider", "gcp", "recipes/ddp_2node.yaml")
    assert code == 4 and "never interruptible" not in text, text


class _Dist:
    def __init__(self, direct_url: str | None):
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        return self.direct_url if name == "direct_url.json" else None


def test_install_hint_follows_how_broker_was_installed(monkeypatch, tmp_path):
    from importlib import metadata

    from broker.core.install import install_hint

    src = tmp_path / "broker-src"
    src.mkdir()
    (src / "pyproject.toml").write_text("[project]\nname = 'broker'\n")
    venv_bin = src / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "pip").write_text("")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    editable = json.dumps({"dir_info": {"editable": True}, "url": src.as_uri()})
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(editable))
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([_Dist(editable)]))
    assert install_hint("gcp", "google-auth", cwd=src) == "`.venv/bin/pip install -e '.[gcp]'` (google-auth)"
    assert install_hint("vast", cwd=tmp_path) == "`broker-src/.venv/bin/pip install -e './broker-src[vast]'`"
    elsewhere = tmp_path / "elsewhere"
    assert install_hint("oci", cwd=elsewhere) == f"`{venv_bin / 'pip'} install -e '{src}[oci]'`"
    # from a wheel or the package index: no direct_url.json, or a download URL
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(None))
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([_Dist(None)]))
    assert install_hint("gcp", cwd=src) == "`pip install 'broker[gcp]'`"
    wheel = json.dumps({"archive_info": {}, "url": "https://example.invalid/broker-0.1.0-py3-none-any.whl"})
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(wheel))
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([_Dist(wheel)]))
    assert install_hint("aws", cwd=src) == "`pip install 'broker[aws]'`"


def test_a_checkouts_own_egg_info_found_first_does_not_hide_the_editable_install(monkeypatch, tmp_path):
    """``python -m broker`` in a checkout: the checkout's ``broker.egg-info`` (no direct_url.json) is found before
    the environment's record, which names the checkout."""
    from importlib import metadata

    from broker.core.install import checkout_dir

    src = tmp_path / "broker-src"
    src.mkdir()
    (src / "pyproject.toml").write_text("[project]\nname = 'broker'\n")
    editable = json.dumps({"dir_info": {"editable": True}, "url": src.as_uri()})
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(None))
    monkeypatch.setattr(metadata, "distributions", lambda **kw: iter([_Dist(None), _Dist(editable)]))
    assert checkout_dir() == src


def test_the_install_command_is_never_split_at_80_columns(bare_env, tmp_path):
    """At 80 columns the hint broke `pip install -e` / `'...[gcp]'` across lines: pasted, neither half works."""
    env = dict(without_google_clients(bare_env, tmp_path), COLUMNS="80", BROKER_NO_WRAP="0")
    p = subprocess.run([sys.executable, "-m", "broker", "run", "--provider", "gcp", "recipes/ddp_2node.yaml"],
                       cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in (p.stdout + p.stderr).splitlines() if "pip install" in ln), "")
    assert "pip install -e '.[gcp]'`" in line, p.stdout + p.stderr
