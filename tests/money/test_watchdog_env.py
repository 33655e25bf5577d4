"""The watchdog serves every run, whatever environment started it: against two EC2 emulators (moto servers), a
watchdog started with the first run's ``AWS_ENDPOINT_URL`` terminates the instances of a second run made with
another endpoint once that run's CLI is killed with SIGKILL; a run whose credentials were only in its CLI's
environment (other keys) is not claimed as guarded by a watchdog that cannot act for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from broker.core.records import Run
from tests.conftest import REPO

pytest.importorskip("moto")

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true"}


#: one EC2 emulator per process: moto keeps its state per process, so two servers in one process are one cloud
SERVER = ("from moto.server import ThreadedMotoServer\n"
          "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\ns.start()\n"
          "print(s.get_host_and_port()[1], flush=True)\nimport sys\nsys.stdin.read()\n")


@pytest.fixture
def two_endpoints():
    procs = [subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        yield [f"http://127.0.0.1:{int(p.stdout.readline())}" for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


#: a `broker run` CLI as far as the watchdog is concerned: it records its run (with its provider settings) and a
#: tagged instance it rented on its endpoint, then drives the job (sleeps) until it is killed
CLI = """
    import json, sys, time
    import boto3
    from broker.core.provider import INSTALL_TAG, RUN_TAG
    from broker.core.recipe import load_recipe
    from broker.money.ledger import Ledger
    from broker.run.runrecord import new_run
    led = Ledger()
    run = new_run(led, load_recipe(sys.argv[1]), provider="aws", topology="multi-node", plan=None)
    ec2 = boto3.client("ec2")  # AWS_ENDPOINT_URL of this process's environment
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    res = led.record_intent(run.id, "aws", "instance", f"broker-{run.id}-n0", usd_per_hour=1.0, region="us-east-1",
                            deadline=run.deadline)
    tags = [{"ResourceType": "instance", "Tags": [{"Key": RUN_TAG, "Value": run.id},
                                                  {"Key": INSTALL_TAG, "Value": led.installation_id}]}]
    iid = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1, InstanceType="t3.micro",
                            TagSpecifications=tags)["Instances"][0]["InstanceId"]
    led.mark_created(res.id, iid, state="running")
    print(json.dumps([run.id, iid]), flush=True)
    time.sleep(600)
"""


def _cli(env: dict[str, str], recipe) -> tuple[subprocess.Popen, str, str]:
    env = {**env, "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLI), str(recipe)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, p.stderr.read()
    run_id, iid = json.loads(line)
    return p, run_id, iid


def _state(url: str, iid: str) -> str:
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    return ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]


def _recipe(tmp_path):
    (tmp_path / "train.py").write_text("print('x')\n")
    (tmp_path / "r.yaml").write_text("name: t\nscript: train.py\nnodes: 1\ngpus_per_node: 0\ncpu_ok: true\n"
                                     "max_hours: 1\n")
    return tmp_path / "r.yaml"


def test_a_watchdog_serves_a_run_made_with_another_endpoint_after_its_cli_is_killed(
        two_endpoints, broker_home, tmp_path, monkeypatch):
    from broker.money.ledger import Ledger
    from broker.money.watchdog import Watchdog

    first, second = two_endpoints
    recipe = _recipe(tmp_path)
    base = {**os.environ, **KEYS}
    cli1, run1, iid1 = _cli({**base, "AWS_ENDPOINT_URL": first}, recipe)
    cli2, run2, iid2 = _cli({**base, "AWS_ENDPOINT_URL": second}, recipe)
    try:
        # the watchdog keeps the environment of the CLI that started it: the first endpoint
        for k, v in {**KEYS, "AWS_ENDPOINT_URL": first}.items():
            monkeypatch.setenv(k, v)
        from broker.core.config import settings

        settings.cache_clear()
        led = Ledger()
        wd = Watchdog(led, interval_s=0.2, ended_grace_s=0, orphan_scan_s=3600, home=broker_home)
        assert [a for a in wd.run_once() if a.kind == "terminate"] == []  # both CLIs alive: nothing to do
        os.kill(cli2.pid, signal.SIGKILL)
        cli2.wait(10)
        acts = []
        for _ in range(5):
            acts += wd.run_once()
            if not led.resources(run2, live_only=True):
                break
        assert not led.resources(run2, live_only=True), [a.to_dict() for a in acts]
        assert _state(second, iid2) == "terminated"
        assert _state(first, iid1) == "running" and led.resources(run1, live_only=True)  # its CLI lives
        assert not any("EndpointConnectionError" in (a.reason or "") for a in acts)
    finally:
        for p in (cli1, cli2):
            p.kill()
            p.wait(10)


def test_a_run_with_other_keys_only_in_its_clis_environment_is_not_called_guarded(two_endpoints, broker_home,
                                                                                 tmp_path, monkeypatch):
    """Keys the watchdog does not have (only in the run's CLI environment): the running watchdog does not act for
    the run and `status` does not call it guarded by a watchdog; the CLI's own start_detached starts a scoped
    watchdog for it, which does."""
    from broker.core import provider_env
    from broker.money.accounting import armed_layers, watchdog_state
    from broker.money.ledger import Ledger
    from broker.money.watchdog import Watchdog

    first, _ = two_endpoints
    recipe = _recipe(tmp_path)
    other = {**os.environ, **KEYS, "AWS_ENDPOINT_URL": first, "AWS_ACCESS_KEY_ID": "other-account"}
    cli, run_id, iid = _cli(other, recipe)
    try:
        for k, v in {**KEYS, "AWS_ENDPOINT_URL": first}.items():
            monkeypatch.setenv(k, v)
        from broker.core.config import settings

        settings.cache_clear()
        led = Ledger()
        wd = Watchdog(led, interval_s=0.2, ended_grace_s=0, orphan_scan_s=3600, home=broker_home)
        wd.write_heartbeat()  # this watchdog is alive and fresh
        run = led.get_run(run_id)
        res = led.resources(run_id, live_only=True)[0]
        assert armed_layers(res, run, watchdog_state(home=broker_home))["watchdog"] is False
        os.kill(cli.pid, signal.SIGKILL)
        cli.wait(10)
        wd.run_once()
        assert run_id in wd.unserved and led.resources(run_id, live_only=True)  # never with the wrong keys
        assert any(e["action"] == "not-served" for e in led.events(run_id))
        # the run's own watchdog (its environment, scoped to it) acts for it
        env = provider_env.read(run.run_dir)
        scope = provider_env.fingerprint(env)
        for k in ("AWS_ACCESS_KEY_ID",):
            monkeypatch.setenv(k, "other-account")
        settings.cache_clear()
        own = Watchdog(led, interval_s=0.2, ended_grace_s=0, orphan_scan_s=3600, home=broker_home, scope=scope)
        own.write_heartbeat()
        assert armed_layers(res, run, watchdog_state(home=broker_home))["watchdog"] is True
        for _ in range(5):
            own.run_once()
            if not led.resources(run_id, live_only=True):
                break
        assert _state(first, iid) == "terminated"
    finally:
        cli.kill()
        cli.wait(10)


def test_start_detached_starts_a_scoped_watchdog_only_for_credentials_the_running_one_lacks(broker_home,
                                                                                          monkeypatch):
    from broker.core import provider_env
    from broker.core.config import settings
    from broker.money.ledger import Ledger
    from broker.money.watchdog import Watchdog, start_detached

    for k, v in KEYS.items():
        monkeypatch.setenv(k, v)
    settings.cache_clear()
    Watchdog(Ledger(), providers={}, home=broker_home).write_heartbeat()  # a live watchdog with these keys
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # another endpoint, same keys: it serves it
    assert start_detached(broker_home, python="/bin/true") is None
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_PROFILE", "other")  # a profile: the running watchdog applies it
    assert start_detached(broker_home, python="/bin/true") is None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "other-account")  # keys only this environment has
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "other-secret")
    assert start_detached(broker_home, python="/bin/true")
    scope = provider_env.fingerprint(provider_env.capture(home=broker_home))
    assert (broker_home / f"watchdog-{scope}.log").exists()


def test_the_recorded_environment_holds_no_secret_and_counts_keys_from_dotenv(broker_home, tmp_path, monkeypatch):
    """``provider_env.json``: endpoints, profiles and file paths as they are, secrets (also those from ``.env``)
    only by name and a keyed digest; the file is 0600 and what it names is refused when it is not broker's."""
    from broker.core import provider_env
    from broker.core.config import settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("AWS_ACCESS_KEY_ID=AKIADOTENV\nAWS_SECRET_ACCESS_KEY=dotenv-secret-value\n")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    monkeypatch.setenv("AWS_PROFILE", "p1")
    settings.cache_clear()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    provider_env.record(run_dir, home=broker_home)
    text = (run_dir / "provider_env.json").read_text()
    assert "dotenv-secret-value" not in text and "AKIADOTENV" not in text
    env = provider_env.read(run_dir)
    assert env["settings"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:5000" and env["settings"]["AWS_PROFILE"] == "p1"
    assert env["secrets"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] and env["secrets_digest"]
    assert (run_dir / "provider_env.json").stat().st_mode & 0o777 == 0o600
    bad = json.loads(text)
    bad["settings"]["AWS_ENDPOINT_URL"] = "http://198.51.100.7/steal"  # plain http to another machine
    (run_dir / "provider_env.json").write_text(json.dumps(bad))
    assert provider_env.read(run_dir) is None
    bad["settings"] = {"PATH": "/tmp/evil"}  # not a provider setting
    (run_dir / "provider_env.json").write_text(json.dumps(bad))
    assert provider_env.read(run_dir) is None
    settings.cache_clear()
