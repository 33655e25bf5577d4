"""`broker quota check|request|status` through the Typer app, with a monkeypatched provider factory:
a fake OCI adapter returning Quota values (the real OCI adapter lives on another branch) and the real AWS
adapter over Stubber-wrapped boto3 clients (request bodies asserted)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from broker.core.model import Quota
from broker.core.provider import AuthError, Provider, ProviderCheck
from broker.core.records import QuotaRequest

runner = CliRunner()


@pytest.fixture(autouse=True)
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    return tmp_path


class FakeOCI(Provider):
    """Returns AD-scoped gpu-a10-count values as the OCI adapter does (unit gpus, scope = AD)."""

    name = "oci"

    def __init__(self, limits: dict[str, tuple[float, float]] | None = None):
        self.limits = limits or {"AD-1": (1, 0), "AD-2": (0, 0)}
        self.filed: list[tuple[Quota, float, str, bool]] = []
        self.states = ["IN_PROGRESS", "SUCCEEDED"]

    def check(self) -> ProviderCheck:
        return ProviderCheck(provider="oci", configured=True)

    def quotas(self, req, offers):
        assert offers and all(o.provider == "oci" for o in offers)
        return [Quota(provider="oci", name="gpu-a10-count", region="us-ashburn-1", scope=ad, limit=lim, used=used,
                      unit="gpus", instance_types=["VM.GPU.A10.1", "VM.GPU.A10.2", "BM.GPU.A10.4"], source="fake")
                for ad, (lim, used) in self.limits.items()]

    def request_quota(self, quota, value, reason, *, draft=False):
        self.filed.append((quota, value, reason, draft))
        form = {"service": "compute", "limit": quota.name, "region": quota.region, "scope": quota.scope,
                "value": value, "reason": reason}
        if draft:
            return QuotaRequest(provider="oci", limit_name=quota.name, region=quota.region, scope=quota.scope,
                                value=value, unit="gpus", reason=reason, form=form)
        return QuotaRequest(provider="oci", limit_name=quota.name, region=quota.region, scope=quota.scope,
                            value=value, unit="gpus", reason=reason, request_id="ocid1.limitsincreaserequest.oc1..x",
                            state="ACCEPTED", form=form)

    def quota_request_status(self, request):
        return request.model_copy(update={"state": self.states.pop(0)})


def use(monkeypatch, **provs: Any) -> None:
    import broker.cli.quota as qc

    def factory(name, region=None):
        if name not in provs:
            raise qc.ProviderUnavailable(f"{name}: provider not available in this install (test)")
        return provs[name]

    monkeypatch.setattr(qc, "provider_factory", factory)


def cli(*args: str):
    from broker.cli.app import app

    return runner.invoke(app, list(args))


def flat(text: str) -> str:
    """``text`` with wrapped prose joined again (lines wrap at the width between words, commands kept whole)."""
    return " ".join(text.split())


def test_check_oci_verdict_and_missing_aws(monkeypatch):
    use(monkeypatch, oci=FakeOCI())
    r = cli("quota", "check", "--instance-type", "VM.GPU.A10.1")
    assert r.exit_code == 0, r.output
    assert "2× VM.GPU.A10.1 needs gpu-a10-count ≥ 2 in one AD; you have 1 available in AD-1" in flat(r.output)
    assert "broker quota request --provider oci --limit gpu-a10-count --value 2 --scope AD-1" in r.output
    assert "0 of 1 GPU used means 1 GPU may be launched" in r.output
    assert "aws: provider not available" in r.output


def test_check_json_ok_in_one_ad(monkeypatch):
    use(monkeypatch, oci=FakeOCI({"AD-1": (1, 0), "AD-2": (4, 1)}))
    r = cli("quota", "check", "-p", "oci", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    p = data["providers"][0]
    assert {q["scope"]: q["available"] for q in p["quotas"]} == {"AD-1": 1, "AD-2": 3}
    v = next(v for v in p["verdicts"] if v["topology"] == "multi-node" and v["limit"] == "gpu-a10-count")
    assert v["ok"] and v["scope"] == "AD-2" and v["units_needed"] == 2 and v["unit"] == "gpus"


def test_check_from_recipe(monkeypatch, tmp_path):
    use(monkeypatch, oci=FakeOCI({"AD-1": (8, 0)}))
    (tmp_path / "train.py").write_text("print('hi')\n")
    rec = tmp_path / "job.yaml"
    rec.write_text("name: three\nscript: train.py\nnodes: 3\ngpus_per_node: 1\ntopology: multi-node\n")
    r = cli("quota", "check", "-p", "oci", "--recipe", str(rec), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["nodes"] == 3
    v = [v for v in data["providers"][0]["verdicts"] if v["limit"] == "gpu-a10-count"]
    assert [(x["topology"], x["instance_type"], x["units_needed"], x["ok"]) for x in v] == [
        ("multi-node", "VM.GPU.A10.1", 3, True)]


def test_check_unknown_instance_type_is_bad_input(monkeypatch):
    from broker.core.provider import BadInput

    use(monkeypatch, oci=FakeOCI())
    r = cli("quota", "check", "-p", "oci", "-t", "VM.GPU.Nope")
    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2


def test_request_oci_sized_per_ad_recorded_and_status(monkeypatch):
    fake = FakeOCI()
    use(monkeypatch, oci=fake)
    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1")
    assert r.exit_code == 0, r.output
    quota, value, reason, draft = fake.filed[0]
    assert (quota.name, quota.scope, value, draft) == ("gpu-a10-count", "AD-1", 2.0, False)
    assert reason.startswith("PyTorch distributed training validation: 2 nodes x 1 GPU")
    assert "state ACCEPTED" in r.output
    from broker.money.ledger import Ledger

    rows = Ledger().quota_requests()
    assert len(rows) == 1 and rows[0]["scope"] == "AD-1" and rows[0]["state"] == "ACCEPTED"
    r = cli("quota", "status")
    assert r.exit_code == 0 and "IN_PROGRESS" in r.output
    r = cli("quota", "status", "--json")
    assert json.loads(r.output)["requests"][0]["state"] == "SUCCEEDED"
    r = cli("quota", "status", "--json")  # final state: not asked again (the fake has no states left)
    assert json.loads(r.output)["requests"][0]["state"] == "SUCCEEDED"


def test_request_oci_draft_prints_form_files_nothing(monkeypatch):
    fake = FakeOCI()
    use(monkeypatch, oci=fake)
    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1", "--draft", "--reason", "DDP smoke test")
    assert r.exit_code == 0, r.output
    assert fake.filed[0][3] is True and "not filed" in r.output and "DDP smoke test" in r.output
    from broker.money.ledger import Ledger

    assert Ledger().quota_requests() == []


def test_request_default_picks_the_reported_blocked_limit(monkeypatch):
    fake = FakeOCI({"AD-1": (1, 0), "AD-2": (0, 0), "AD-3": (2, 2)})
    use(monkeypatch, oci=fake)
    r = cli("quota", "request", "-p", "oci", "--draft")
    assert r.exit_code == 0, r.output
    quota, value, _, draft = fake.filed[0]
    assert (quota.name, quota.scope, value, draft) == ("gpu-a10-count", "AD-1", 2.0, True)
    r = cli("quota", "check", "-p", "oci", "--json")
    p = json.loads(r.output)["providers"][0]
    assert {v["limit"] for v in p["verdicts"]} == {"gpu-a10-count"}
    assert "gpu2-count" in p["not_reported"]


def test_request_not_needed(monkeypatch):
    fake = FakeOCI({"AD-1": (8, 0)})
    use(monkeypatch, oci=fake)
    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1")
    assert r.exit_code == 0 and "no increase needed" in r.output and fake.filed == []


# ------------------------------------------------------------------------------------------- AWS over Stubber
class Stubs:
    def __init__(self) -> None:
        self.clients: dict[str, Any] = {}
        self.stubbers: dict[str, Any] = {}

    def __call__(self, service, region, cfg):
        import boto3
        from botocore.stub import Stubber

        if service not in self.clients:
            c = boto3.client(service, region_name=region, aws_access_key_id="t", aws_secret_access_key="t")
            self.stubbers[service] = Stubber(c)
            self.stubbers[service].activate()
            self.clients[service] = c
        return self.clients[service]

    def stub(self, service):
        self(service, "us-east-1", None)
        return self.stubbers[service]


def aws_with_limit(stubs: Stubs, value: float, used: float = 0.0):
    from botocore.stub import ANY

    from broker.providers.aws import AWSProvider

    ec2 = stubs.stub("ec2")
    ec2.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
        {"InstanceType": "g5.xlarge", "LocationType": "availability-zone", "Location": "us-east-1a"}]})
    ec2.add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": "g5.xlarge"}]}, {
        "InstanceTypes": ANY})
    stubs.stub("service-quotas").add_response("get_service_quota", {"Quota": {
        "ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "QuotaName": "Running On-Demand G and VT instances",
        "Value": value, "Unit": "None"}}, {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    stubs.stub("cloudwatch").add_response("get_metric_statistics", {"Datapoints": (
        [{"Maximum": used}] if used else [])})
    return AWSProvider(client_factory=stubs, region="us-east-1")


def test_aws_check_real_adapter(monkeypatch):
    stubs = Stubs()
    use(monkeypatch, aws=aws_with_limit(stubs, 4.0))
    r = cli("quota", "check", "-p", "aws", "-t", "g5.xlarge")
    assert r.exit_code == 0, r.output
    assert ("2× g5.xlarge needs 8 vCPUs of L-DB2E81BA (Running On-Demand G and VT instances) in us-east-1; "
            "you have 4 available in us-east-1 (= 1× g5.xlarge)") in flat(r.output)
    assert "broker quota request --provider aws --limit L-DB2E81BA --value 8 --region us-east-1" in r.output


def test_aws_request_files_vcpus_on_demand_and_status_denied(monkeypatch):
    stubs = Stubs()
    prov = aws_with_limit(stubs, 4.0, used=4.0)
    sq = stubs.stub("service-quotas")
    sq.add_response("request_service_quota_increase", {"RequestedQuota": {
        "Id": "req-1", "QuotaCode": "L-DB2E81BA", "DesiredValue": 12.0, "Status": "PENDING"}},
        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "DesiredValue": 12.0})  # used 4 + 2x4 needed; not spot
    use(monkeypatch, aws=prov)
    r = cli("quota", "request", "-p", "aws", "-t", "g5.xlarge")
    assert r.exit_code == 0, r.output
    assert "request req-1 state PENDING" in r.output and "needs 8 vcpus of L-DB2E81BA" in r.output
    sq.add_response("get_requested_service_quota_change", {"RequestedQuota": {
        "Id": "req-1", "QuotaCode": "L-DB2E81BA", "DesiredValue": 12.0, "Status": "DENIED"}}, {"RequestId": "req-1"})
    r = cli("quota", "status", "--json")
    row = json.loads(r.output)["requests"][0]
    assert (row["provider_request_id"], row["state"], row["unit"]) == ("req-1", "DENIED", "vcpus")
    assert "denied" in row["note"]
    sq.assert_no_pending_responses()


def test_aws_request_open_request_not_duplicated_in_ledger(monkeypatch):
    stubs = Stubs()
    sq = stubs.stub("service-quotas")
    for _ in range(2):
        sq.add_client_error("request_service_quota_increase", service_error_code="ResourceAlreadyExistsException",
                            http_status_code=400, expected_params={"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA",
                                                                   "DesiredValue": 16.0})
        sq.add_response("list_requested_service_quota_change_history_by_quota", {"RequestedQuotas": [
            {"Id": "req-open", "QuotaCode": "L-DB2E81BA", "DesiredValue": 16.0, "Status": "PENDING"}]})
    from broker.providers.aws import AWSProvider

    use(monkeypatch, aws=AWSProvider(client_factory=stubs, region="us-east-1"))
    monkeypatch.setattr(AWSProvider, "check", lambda self: ProviderCheck(provider="aws", configured=False))
    for _ in range(2):
        r = cli("quota", "request", "-p", "aws", "-t", "g5.xlarge", "--value", "16")
        assert r.exit_code == 0, r.output
        assert "already open" in r.output and "req-open" in r.output
    from broker.money.ledger import Ledger

    assert len(Ledger().quota_requests()) == 1


def without_aws_credentials(monkeypatch, tmp_path) -> None:
    """Undo this module's test credentials: no AWS key in the environment, no credentials or config file."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none2"))


def test_aws_spot_only_when_asked(monkeypatch, tmp_path):
    without_aws_credentials(monkeypatch, tmp_path)
    from broker.providers.aws import AWSProvider

    use(monkeypatch, aws=AWSProvider(region="us-east-1"))
    r = cli("quota", "check", "-p", "aws", "-t", "g5.xlarge", "--json")
    assert [v["limit"] for v in json.loads(r.output)["providers"][0]["verdicts"]] == ["L-DB2E81BA"]
    r = cli("quota", "check", "-p", "aws", "-t", "g5.xlarge", "--spot", "--json")
    assert [v["limit"] for v in json.loads(r.output)["providers"][0]["verdicts"]] == ["L-3819A6DF"]


def test_aws_request_permission_error_is_clear(monkeypatch):
    stubs = Stubs()
    stubs.stub("service-quotas").add_client_error("request_service_quota_increase",
                                                  service_error_code="AccessDeniedException", http_status_code=400)
    from broker.providers.aws import AWSProvider

    use(monkeypatch, aws=AWSProvider(client_factory=stubs, region="us-east-1"))
    monkeypatch.setattr(AWSProvider, "check", lambda self: ProviderCheck(provider="aws", configured=False))
    r = cli("quota", "request", "-p", "aws", "-t", "g5.xlarge", "--value", "8")
    assert isinstance(r.exception, AuthError) and r.exception.exit_code == 4
    assert "servicequotas:RequestServiceQuotaIncrease" in str(r.exception)


def test_aws_request_draft_without_credentials(monkeypatch, tmp_path):
    without_aws_credentials(monkeypatch, tmp_path)
    from broker.providers.aws import AWSProvider

    use(monkeypatch, aws=AWSProvider(region="us-east-1"))
    r = cli("quota", "request", "-p", "aws", "-t", "p5.48xlarge", "--nodes", "1", "--gpus-per-node", "8", "--draft")
    assert r.exit_code == 0, r.output
    assert "L-417A185B" in r.output and "192" in r.output and "Running On-Demand P instances" in r.output
    assert "unknown (not read)" in r.output


def test_real_factory_reports_missing_module(monkeypatch):
    import broker.providers as providers

    from broker.cli.quota import ProviderUnavailable, provider_factory

    monkeypatch.setitem(providers.REGISTRY, "oci", "providers.no_such_module:X")
    with pytest.raises(ProviderUnavailable, match="not available"):
        provider_factory("oci")
    assert provider_factory("aws", "eu-west-1").region == "eu-west-1"


def test_oci_draft_without_credentials_leaves_the_ad_to_fill_in(monkeypatch, tmp_path):
    """Without an OCI config the ADs cannot be listed: the draft still prints, with the AD and region to fill in;
    filing for real still insists on --scope."""
    from broker.providers.oci import OCIProvider

    monkeypatch.setenv("OCI_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("OCI_REGION", raising=False)
    use(monkeypatch, oci=OCIProvider())
    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1", "--draft")
    assert r.exit_code == 0, r.output
    assert "gpu-a10-count" in r.output and "not filed" in r.output
    assert "<your availability domain" in r.output and "<your region" in r.output
    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1")
    from broker.core.provider import BadInput

    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2 and "--scope" in str(r.exception)


@pytest.mark.parametrize("value,words", [("-3", "whole number"), ("0", "whole number"), ("1.5", "whole number"),
                                         ("1", "already 1"), ("1e8", "above the 1024")])
def test_request_refuses_a_value_that_cannot_raise_the_limit(monkeypatch, value, words):
    fake = FakeOCI()  # AD-1: limit 1, used 0
    use(monkeypatch, oci=fake)
    from broker.core.provider import BadInput

    r = cli("quota", "request", "-p", "oci", "-t", "VM.GPU.A10.1", "--scope", "AD-1", "--value", value)
    assert isinstance(r.exception, BadInput) and r.exception.exit_code == 2, r.output
    assert words in flat(str(r.exception)) and "--value" in r.exception.hint
    assert fake.filed == []  # nothing filed
    from broker.money.ledger import Ledger

    assert Ledger().quota_requests() == []


def test_quota_status_takes_a_provider(monkeypatch):
    use(monkeypatch, oci=FakeOCI())
    from broker.money.ledger import Ledger

    with Ledger() as led:
        led.add_quota_request("oci", "gpu-a10-count", 2, scope="AD-1", unit="gpus", state="SUCCEEDED")
        led.add_quota_request("aws", "L-DB2E81BA", 8, region="us-east-1", unit="vcpus", state="DENIED")
    r = cli("quota", "status", "--provider", "aws", "--json", "--no-refresh")
    assert r.exit_code == 0, r.output
    assert [x["provider"] for x in json.loads(r.output)["requests"]] == ["aws"]
    from broker.core.provider import BadInput

    assert isinstance(cli("quota", "status", "--provider", "vast").exception, BadInput)


def test_quota_check_on_a_provider_without_quotas_says_what_to_use(cli_env):
    """`quota check --provider vast` ended with no `->` line."""
    import subprocess
    import sys

    cp = subprocess.run([sys.executable, "-m", "broker", "quota", "check", "--provider", "vast"], env=cli_env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2
    text = " ".join(cp.stderr.split())
    assert "-> vast has no service limits to read" in text and "broker offers --provider vast" in text, text


@pytest.mark.parametrize("provider, region, whole", [
    ("aws", "us-east-1", ["https://us-east-1.console.aws.amazon.com/servicequotas/home/services/ec2/quotas/"]),
    ("gcp", "us-east1", ["https://console.cloud.google.com/iam-admin/quotas?project=", "gcloud beta quotas "
                         "preferences create --service=compute.googleapis.com"])])
def test_a_draft_prints_its_console_url_and_command_whole_outside_the_table(cli_env, provider, region, whole):
    """At 80 columns `quota request --draft` split the console URL and the gcloud command across table rows."""
    import subprocess
    import sys

    env = dict(cli_env, COLUMNS="80", BROKER_NO_WRAP="0")
    cp = subprocess.run([sys.executable, "-m", "broker", "quota", "request", "--provider", provider, "--draft",
                         "--region", region], env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    for piece in whole:
        line = next((ln for ln in lines if piece in ln), None)
        assert line is not None and "│" not in line, cp.stdout  # on a line of its own, not in a table cell
    if provider == "gcp":
        cmd = next(ln for ln in lines if "gcloud beta" in ln)
        assert cmd.rstrip().endswith("--email=EMAIL"), cp.stdout  # the whole command on one line
        import shlex

        words = shlex.split(cmd)  # pasteable: no `<...>` a shell takes for a redirection
        assert "--project=PROJECT_ID" in words and not any(w.startswith(("<", ">")) for w in words), words
