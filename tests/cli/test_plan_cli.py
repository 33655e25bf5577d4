"""`broker plan`, `broker offers`, `broker check`, `broker catalog` through the Typer app, offline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.plan import catalog
from broker.providers.oci import prices as oci_prices
from broker.cli.app import app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No credentials, a private broker home, and any network connection attempt fails the test."""
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    for k in list(os.environ):
        if k.startswith("AWS_") or k.startswith("VAST_") or k.startswith("OCI_"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OCI_CONFIG_FILE", str(tmp_path / "no-oci-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.vast_api_key, ~/.oci, ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    from broker.core.config import settings

    settings.cache_clear()
    catalog._CACHE.clear()

    def no_network(*a, **k):
        raise AssertionError(f"network call attempted: {a!r}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    yield
    settings.cache_clear()


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def flat(text: str) -> str:
    """``text`` with wrapped prose joined again (lines wrap at the width between words, commands kept whole)."""
    return " ".join(text.split())


def test_plan_budget_5_from_snapshot_without_credentials():
    r = run("plan", "--budget", "5")
    assert r.exit_code == 0, r.output
    assert "snapshot 2026-11-29" in r.output
    assert "live quote needs VAST_API_KEY" in r.output
    # the chosen cloud has no credentials here: the next step says to configure it first (it said just
    # `broker run ... --provider vast`, which then failed)
    assert "chosen:" in r.output and "next: configure vast (VAST_API_KEY" in r.output
    assert "then broker run RECIPE.yaml --provider vast" in flat(r.output)
    assert "rejected" in r.output


def test_plan_says_under_its_first_line_that_its_prices_are_the_shipped_snapshots(tmp_path):
    """With no credentials the plan's prices are the dated snapshots shipped in the package: the second line says
    so, with their dates, before any table (it was said only per provider, in notes at the end, and never that the
    snapshots came with broker); a snapshot refreshed into the home is named as refreshed."""
    r = run("plan", "--budget", "5")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = flat("\n".join(lines[:6]))
    assert "prices: dated snapshots shipped with broker, 2026-11-29 to 2026-12-01; no provider was asked" in head
    assert head.index("prices:") < head.index("best options")
    # the notes name what the user sees, not a snapshot file's column ("Spot VM totals in its
    # interruptible_usd_per_hour column")
    assert "interruptible_usd_per_hour" not in r.output and "Spot VM prices from the same snapshot" in flat(r.output)
    (tmp_path / "home" / "catalog").mkdir(parents=True, exist_ok=True)
    (tmp_path / "home" / "catalog" / catalog.snapshot_file("vast")).write_text(
        catalog.shipped_path("vast").read_text())
    catalog._CACHE.clear()
    r = run("plan", "--budget", "5")
    assert "prices: dated snapshots shipped with broker (vast refreshed)" in flat(r.output)


def test_plan_json_chosen_option_and_local_explained():
    r = run("plan", "--budget", "5", "--no-cpu-ok", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    chosen = data["chosen"]
    assert chosen["worst_case_usd"] <= 5
    assert chosen["provider"] in ("vast", "oci", "aws", "local")
    assert "broker run RECIPE.yaml --provider " in data["next_step"] and data["schema_version"] == 1
    plan = data["plan"]
    assert any("snapshot 2026-11-29" in n for n in plan["notes"])
    if chosen["provider"] != "local":  # this machine has too few GPUs: local is rejected with its reason
        local = [o for o in plan["rejected"] if o["provider"] == "local"]
        assert local and local[0]["rejected"]
    if chosen["provider"] == "vast":
        assert chosen["topology"] == "simulated"


def test_plan_snapshot_choice_is_vast_3090_when_no_local_gpus():
    r = run("plan", "--budget", "5", "--provider", "vast", "--provider", "oci", "--provider", "aws", "--json")
    assert r.exit_code == 0, r.output
    c = json.loads(r.output)["chosen"]
    assert (c["provider"], c["topology"], c["offers"][0]["instance_type"]) == ("vast", "simulated", "2x RTX 3090")
    assert c["price_source"] == "snapshot 2026-11-29 (SkyPilot catalog medians)"
    assert c["worst_case_usd"] == pytest.approx(0.385 + 7 / 730, abs=1e-9)


def test_plan_no_valid_option_exits_3():
    r = run("plan", "--budget", "0.05", "--provider", "vast", "--provider", "aws")
    assert r.exit_code == 3
    assert "worst case" in r.output
    assert "cheapest option blocked only by the budget: simulated 2x RTX 3090" in r.output


def test_plan_with_recipe_cpu_ok_chooses_local():
    r = run("plan", "--recipe", str(ROOT / "recipes" / "ddp_2node.yaml"), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["chosen"]["provider"] == "local" and data["chosen"]["worst_case_usd"] == 0
    assert data["plan"]["requirements"]["hours"] == 0.5 and data["plan"]["requirements"]["budget_usd"] == 5
    assert data["next_step"].endswith("ddp_2node.yaml --provider local")


def test_plan_max_run_uses_the_budget_as_deadline():
    r = run("plan", "--budget", "5", "--max-run", "--provider", "vast", "--json")
    c = json.loads(r.output)["chosen"]
    assert c["hours"] == pytest.approx(52619 / 3600, abs=1e-9) and c["worst_case_usd"] <= 5


def test_a_failing_adapter_is_a_note_not_a_crash(monkeypatch):
    import broker.providers as providers
    from broker.core.provider import Provider, TransientError

    class Boom(Provider):
        name = "vast"

        def offers(self, req):
            raise TransientError("vast", "offers", "HTTP 503")

    real = providers.get_provider
    monkeypatch.setattr(providers, "get_provider", lambda n, **k: Boom() if n == "vast" else real(n, **k))
    r = run("plan", "--budget", "5", "--provider", "vast", "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.output)["plan"]["notes"]
    assert any("offers failed" in n and "HTTP 503" in n and "snapshot 2026-11-29" in n for n in notes)


def test_offers_lists_raw_offers_filtered():
    r = run("offers", "--gpu", "A10", "--provider", "oci", "--json")
    assert r.exit_code == 0, r.output
    types = [o["instance_type"] for o in json.loads(r.output)["offers"]]
    assert types == ["VM.GPU.A10.1", "VM.GPU.A10.2", "BM.GPU.A10.4"]
    r = run("offers", "--num-gpus", "8", "--min-gpu-mem", "80", "--limit", "2", "--json")
    data = json.loads(r.output)
    assert len(data["offers"]) == 2 and all(o["gpu_count"] >= 8 for o in data["offers"])
    r = run("offers", "--gpu", "RTX 4090")
    assert r.exit_code == 0 and "RTX 4090" in r.output


def test_check_reports_each_provider():
    r = run("check", "--json")
    assert r.exit_code == 0, r.output
    rows = {x["provider"]: x for x in json.loads(r.output)["providers"]}
    assert set(rows) == {"local", "vast", "oci", "aws", "gcp"}
    assert rows["local"]["configured"] is True
    for p in ("vast", "oci", "aws", "gcp"):
        assert rows[p]["configured"] is False  # no credentials (or no adapter yet)


#: An answer of Oracle's public price list, in the shape public price collectors read ([3rd-party], see
#: broker.providers.oci.prices.OCI_PRICE_LIST_URL): GPU SKUs per GPU-hour, pay-as-you-go.
OCI_PRICE_LIST = {"items": [
    {"partNumber": "B95909", "displayName": "Compute - GPU - A10", "metricName": "GPU Per Hour",
     "serviceCategory": "Compute - GPU",
     "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 1.9}]}]},
    {"partNumber": "B98415", "displayName": "Compute - GPU - H100", "metricName": "GPU Per Hour",
     "serviceCategory": "Compute - GPU",
     "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 10}]}]},
    {"partNumber": "B93000", "displayName": "Compute - Standard - E4 - OCPU", "metricName": "OCPU Per Hour",
     "serviceCategory": "Compute - Virtual Machine",
     "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 0.025}]}]},
]}


def test_catalog_show_and_refresh_without_credentials():
    import httpx
    import respx

    r = run("catalog", "show")
    assert r.exit_code == 0 and "snapshot 2026-11-29" in r.output and "ASSUMPTION" in r.output
    with respx.mock(assert_all_called=True) as mock:
        route = mock.get(oci_prices.OCI_PRICE_LIST_URL).mock(return_value=httpx.Response(200, json=OCI_PRICE_LIST))
        r = run("catalog", "refresh")
    assert r.exit_code == 0, r.output
    assert route.calls.last.request.url.params["currencyCode"] == "USD"
    assert flat(r.output).count("keeping snapshot 2026-11-29") == 2  # vast and aws: no credentials
    assert "vast: no credentials" in r.output or "vast: adapter" in r.output
    assert "oci: wrote 8 offers" in r.output
    catalog._CACHE.clear()
    offers = {o.instance_type: o for o in catalog.snapshot_offers("oci")}
    assert offers["VM.GPU.A10.2"].usd_per_hour == pytest.approx(3.8)  # 1.9 $/GPU-h x 2
    assert offers["BM.GPU.H100.8"].usd_per_hour == pytest.approx(80.0)
    assert offers["VM.GPU3.1"].usd_per_hour == 2.95  # no V100 SKU in the answer: carried over
    assert "carried over" in offers["VM.GPU3.1"].attrs["notes"]
    assert catalog.snapshot_meta("oci")["overlay"] and catalog.snapshot_info("vast")[0] == "2026-11-29"


def test_catalog_refresh_unreachable_price_list_keeps_the_snapshot():
    import httpx
    import respx

    with respx.mock() as mock:
        mock.get(oci_prices.OCI_PRICE_LIST_URL).mock(return_value=httpx.Response(503, text="busy"))
        r = run("catalog", "refresh", "--provider", "oci")
    assert r.exit_code == 4
    assert "oci: refresh failed" in r.output and "keeping snapshot 2026-11-29" in r.output
    assert not catalog.snapshot_meta("oci")["overlay"]


def test_catalog_refresh_uses_the_adapters_live_sources(monkeypatch):
    import broker.providers as providers
    from broker.core.model import Offer
    from broker.core.provider import Provider, ProviderCheck

    class LiveVast(Provider):
        name = "vast"

        def check(self):
            return ProviderCheck(provider="vast", configured=True)

        def live_offers(self, req):
            o = catalog.snapshot_offers("vast")[0]
            return [replace(o, offer_id="4242", usd_per_hour=0.21, price_source="live vast")]

    class LiveAws(Provider):
        name = "aws"

        def check(self):
            return ProviderCheck(provider="aws", configured=True)

        def live_prices(self, types):
            assert "g5.xlarge" in types
            return {"g5.xlarge": 0.99}

    fakes = {"vast": LiveVast, "aws": LiveAws}
    monkeypatch.setattr(providers, "get_provider", lambda n, **k: fakes[n]())
    r = run("catalog", "refresh", "--provider", "vast", "--provider", "aws")
    assert r.exit_code == 0, r.output
    catalog._CACHE.clear()
    [v] = catalog.snapshot_offers("vast")
    assert (v.offer_id, v.usd_per_hour) == ("4242", 0.21)
    aws = {o.instance_type: o for o in catalog.snapshot_offers("aws")}
    assert aws["g5.xlarge"].usd_per_hour == 0.99 and aws["g4dn.xlarge"].usd_per_hour == 0.526
    assert isinstance(aws["g5.xlarge"], Offer) and "Pricing API" in catalog.snapshot_info("aws")[1]


def test_cli_subprocess_plans_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), OCI_CONFIG_FILE=str(tmp_path / "none"), HOME=str(tmp_path),
               AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run([sys.executable, "-m", "broker", "plan", "--budget", "5"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "snapshot 2026-11-29" in out.stdout and "chosen:" in out.stdout


def test_a_broken_adapter_constructor_falls_back_to_the_snapshot(monkeypatch):
    import broker.providers as providers

    real = providers.get_provider

    def get(name, **k):
        if name == "oci":
            raise AttributeError("'Settings' object has no attribute 'oci_x'")
        return real(name, **k)

    monkeypatch.setattr(providers, "get_provider", get)
    r = run("plan", "--budget", "50", "--provider", "oci", "--gpu", "A10", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["chosen"]["provider"] == "oci"
    assert any("adapter failed to start" in n and "snapshot 2026-11-29" in n for n in data["plan"]["notes"])


def test_equal_options_in_several_zones_are_one_row():
    from broker.cli.plan import group_zones, rented
    from broker.core.model import Capacity, Requirements
    from broker.plan.planner import plan

    g4 = [o for o in catalog.snapshot_offers("aws") if o.instance_type == "g4dn.xlarge"]
    caps = [Capacity(provider="aws", region="us-east-1", zone=z, instance_type="g4dn.xlarge", status="UNKNOWN")
            for z in ("us-east-1a", "us-east-1b", "us-east-1c")]
    p = plan(Requirements(budget_usd=5, hours=1), g4, [], caps)
    assert [o.offers[0].zone for o in p.options] == ["us-east-1a", "us-east-1b", "us-east-1c"]
    [(opt, zones)] = group_zones(p.options)
    assert rented(opt, zones) == "2 x g4dn.xlarge (us-east-1/us-east-1a,us-east-1b,us-east-1c)"


def test_gpu_less_machine_without_cpu_ok_explains_local_and_rents(monkeypatch):
    import broker.providers.local as local

    monkeypatch.setattr(local, "detect_gpus", lambda *a, **k: [])
    r = run("plan", "--budget", "5", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    [loc] = [o for o in data["plan"]["rejected"] if o["provider"] == "local"]
    assert "no GPU" in loc["rejected"][0] and "cpu_ok" in loc["rejected"][0]
    c = data["chosen"]
    assert (c["provider"], c["topology"], c["offers"][0]["instance_type"]) == ("vast", "simulated", "2x RTX 3090")
    # the cheapest multi-node alternative on a private network is listed too
    assert any(o["topology"] == "multi-node" and o["provider"] in ("aws", "oci") for o in data["plan"]["options"])
    r = run("plan", "--budget", "5", "--cpu-ok", "--json")
    assert json.loads(r.output)["chosen"]["provider"] == "local"


def test_vast_query_reaches_the_vast_adapter(monkeypatch):
    import broker.providers as providers
    from broker.core.provider import BadInput, Provider

    seen = {}

    class Vast(Provider):
        name = "vast"

        def offers(self, req, vast_query=None):
            seen["q"] = vast_query
            if vast_query == "bad>>":
                raise BadInput("cannot parse --vast-query 'bad>>'")
            return catalog.snapshot_offers("vast", req)

    monkeypatch.setattr(providers, "get_provider", lambda n, **k: Vast())
    r = run("offers", "--provider", "vast", "--vast-query", "reliability>0.98", "--json")
    assert r.exit_code == 0 and seen["q"] == "reliability>0.98"
    with pytest.raises(BadInput):
        run("plan", "--budget", "5", "--provider", "vast", "--vast-query", "bad>>")


def test_unknown_gpu_model_is_named_with_the_known_ones():
    """`--gpu "RTX 9999"` said only "every option is rejected (reasons above)" with no reason about the model."""
    r = run("plan", "--budget", "5", "--gpu", "RTX 9999", "--no-cpu-ok")
    assert r.exit_code == 3
    assert "no offer has GPU model RTX 9999; models in the price snapshots: " in r.output
    assert "RTX 4090" in r.output and "vast: snapshot 2026-11-29" in r.output


def test_no_valid_plan_in_json_mode_carries_an_error_object_and_a_stderr_line(tmp_path):
    """`broker plan --gpu H900 --json` exited 3 with `chosen: null`, no error object and nothing on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), OCI_CONFIG_FILE=str(tmp_path / "none"), HOME=str(tmp_path),
               AWS_EC2_METADATA_DISABLED="true", COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "broker", "plan", "--gpu", "H900", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    doc = json.loads(out.stdout)
    assert doc["chosen"] is None and doc["plan"]["rejected"]
    e = doc["error"]
    assert e["kind"] == "no_valid_plan" and e["exit_code"] == 3 and e["message"] and e["hint"]
    lines = out.stderr.splitlines()
    assert lines and lines[0].startswith("error: no valid plan") and "{" not in out.stderr, out.stderr


def test_plan_header_and_no_plan_hint_follow_the_job(tmp_path):
    """The second trial: a CPU-only job's header read "2 node(s) x 0 GPU (>= 16 GiB, any model)", and `broker plan`
    ended every no-valid-plan with "relax the job, raise the budget or request quota" whatever the reasons."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), OCI_CONFIG_FILE=str(tmp_path / "none"), HOME=str(tmp_path),
               AWS_EC2_METADATA_DISABLED="true", COLUMNS="80", BROKER_NO_WRAP="1")

    def plan(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "broker", "plan", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    cpu = plan("--cpu-only")
    assert cpu.returncode == 0 and "job: 2 node(s), CPU only (gloo)," in cpu.stdout and "0 GPU" not in cpu.stdout
    gpu = plan("--gpu", "H900", "--provider", "aws")
    assert gpu.returncode == 3 and "relax the job" not in gpu.stderr, gpu.stderr
    assert "no offer matched the job" in gpu.stderr and "models in the price snapshots" in gpu.stdout


def test_no_plan_hints_name_the_flags_or_the_fields_the_user_used(tmp_path):
    """`broker plan --budget 0.1` (flags only) said "raise budget_usd or lower max_hours; set cpu_ok: true in the
    recipe"; with a recipe the budget line said "raise --budget or shorten --hours".  Each names what was used."""
    flags = run("plan", "--budget", "0.1", "--offline")
    assert flags.exit_code == 3
    out = flat(flags.output)
    assert "raise --budget or lower --hours; add --cpu-ok" in out and "(raise --budget or shorten --hours)" in out
    assert "budget_usd" not in out and "max_hours" not in out and "set cpu_ok: true in the recipe" not in out, out
    (tmp_path / "job.py").write_text("print(1)\n")
    (tmp_path / "r.yaml").write_text("name: j\nscript: job.py\nbudget_usd: 0.1\nmax_hours: 1\n")
    fields = flat(run("plan", "--recipe", str(tmp_path / "r.yaml"), "--offline").output)
    assert "raise budget_usd or lower max_hours; set cpu_ok: true in the recipe" in fields, fields
    assert "(raise budget_usd or shorten max_hours)" in fields and "--budget" not in fields
    mixed = flat(run("plan", "--recipe", str(tmp_path / "r.yaml"), "--budget", "0.1", "--offline").output)
    assert "raise --budget or lower max_hours" in mixed, mixed


def test_a_plan_blocked_only_by_the_topology_says_what_would_serve_it():
    """Hybrid on a provider whose VMs cannot host the tunnel: the last hint named only --cpu-ok, and with --cpu-ok
    there was still no plan; the topology's own reason (which providers can host the cloud side) is the hint."""
    r = run("plan", "--budget", "5", "--topology", "hybrid", "--provider", "vast", "--cpu-ok")
    assert r.exit_code != 0
    last = flat(r.output).split("no valid plan:", 1)[1]
    assert "use oci or aws or gcp for the cloud side" in last, r.output
    assert "relax the job" not in last
    r = run("plan", "--budget", "5", "--topology", "hybrid", "--provider", "vast", "--no-cpu-ok")
    last = flat(r.output).split("no valid plan:", 1)[1]
    assert "use oci or aws or gcp for the cloud side" in last and "--cpu-ok" in last, r.output
