"""`broker quota check|request` for GCP through the Typer app with the real GCP adapter and no credentials: the
sentences use the limit's unit (GPUs), unknown limits are unknown (not "not ok"), the regional quota carries its
region, GPUS_ALL_REGIONS is requestable, a typo lists GCP's own metrics, and an unconfigured request says why it
was not filed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("google.auth")
runner = CliRunner()


@pytest.fixture(autouse=True)
def no_gcp_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    for k in ("GCP_REGION", "GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT", "GCP_QUOTA_CONTACT_EMAIL"):
        monkeypatch.delenv(k, raising=False)


def cli(*args: str):
    from broker.cli.app import app

    return runner.invoke(app, list(args))


def flat(text: str) -> str:
    return " ".join(text.split())


def test_check_counts_gcp_limits_in_gpus_and_unknown_is_not_a_no():
    r = cli("quota", "check", "--provider", "gcp", "--json")
    assert r.exit_code == 0, r.output
    v = json.loads(r.output)["providers"][0]["verdicts"]
    t4 = next(x for x in v if x["limit"] == "NVIDIA_T4_GPUS")
    assert "needs 2 GPUs of NVIDIA_T4_GPUS" in t4["sentence"] and "vCPU" not in t4["sentence"], t4
    assert t4["ok"] is None  # the limit was not read: unknown, not "too low"
    r = cli("quota", "check", "--provider", "gcp")
    assert "vCPUs of NVIDIA" not in flat(r.output)


@pytest.mark.parametrize("draft", [True, False])
def test_request_for_a_regional_gpu_quota_names_the_region(draft):
    r = cli("quota", "request", "--provider", "gcp", *(["--draft"] if draft else []))
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "NVIDIA-T4-GPUS-per-project-region" in out
    assert "(none: project-wide)" not in out and "--dimensions=region=us-central1" in out, out
    r = cli("quota", "request", "--provider", "gcp", "--json", *(["--draft"] if draft else []))
    form = json.loads(r.output)["request"]["form"]
    assert form["dimensions"] == {"region": "us-central1"}


def test_request_without_credentials_says_gcp_is_not_configured_not_draft():
    r = cli("quota", "request", "--provider", "gcp")
    assert r.exit_code == 0, r.output
    out = flat(r.output)
    assert "not filed: --draft" not in out, out
    assert "not filed: gcp is not configured" in out and "GOOGLE_APPLICATION_CREDENTIALS" in out, out
    r = cli("quota", "request", "--provider", "gcp", "--draft")
    assert "not filed: --draft" in flat(r.output)


def test_gpus_all_regions_is_checked_and_requestable_project_wide():
    r = cli("quota", "check", "--provider", "gcp", "--json")
    v = json.loads(r.output)["providers"][0]["verdicts"]
    g = [x for x in v if x["limit"] == "GPUS_ALL_REGIONS"]
    assert g and g[0]["units_needed"] == 2 and g[0]["unit"] == "gpus", v
    assert "--region" not in (g[0]["next_step"] or ""), g
    r = cli("quota", "request", "--provider", "gcp", "--limit", "GPUS_ALL_REGIONS", "--value", "2", "--draft",
            "--json")
    assert r.exit_code == 0, r.output
    form = json.loads(r.output)["request"]["form"]
    assert form["quotaId"] == "GPUS-ALL-REGIONS-per-project" and form["preferredValue"] == 2
    assert form["dimensions"] == "(none: project-wide)" and "--dimensions" not in form["gcloud"], form


def test_a_mistyped_gcp_limit_lists_gcps_own_metrics():
    r = cli("quota", "request", "--provider", "gcp", "--limit", "NVIDIA_T5_GPUS", "--draft")
    e = r.exception
    assert e is not None and e.exit_code == 2, r.output
    out = flat(f"{e} {e.hint}")
    assert "NVIDIA_T4_GPUS" in out and "GPUS_ALL_REGIONS" in out and "NVIDIA_L4_GPUS" in out, out
    assert "gpu-a10-count" not in out and "L-DB2E81BA" not in out, out


def test_help_texts_name_every_quota_and_run_provider_from_the_registry():
    from broker import providers as registry

    out = flat(cli("--help").output)
    assert "(" + ", ".join(registry.QUOTA) + ")" in out and "gcp" in out, out
    out = flat(cli("quota", "request", "--help").output)
    assert "gcp: GPUs" in out and "aws: vCPUs" in out and " or ".join(registry.QUOTA) in out, out
    out = flat(cli("run", "--help").output)
    assert "vast, oci, aws, gcp" in out, out
