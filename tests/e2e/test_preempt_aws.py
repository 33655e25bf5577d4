"""A preempted interruptible run on the real AWS adapter (boto3) against moto in server mode, behind a thin EC2 front
(tests/support/ec2_spot.py) that adds what moto lacks: instances are netns hosts with a real sshd, and EC2's Spot
service can take an instance back (its host is lost, moto terminates it, DescribeInstances reads ``StateReason``
``Server.SpotInstanceTermination``, its spot request ``instance-terminated-no-capacity``).  Driven through the
pipeline's restart loop (broker.run.attempts.run_attempts): broker records the preemption, terminates what is left,
rents spot again, puts the checkpoint back and the shipped ddp_train.py resumes from it."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from broker.core.model import utcnow  # noqa: E402
from broker.core.recipe import load_recipe  # noqa: E402
from broker.money.ledger import Ledger  # noqa: E402
from broker.plan.planner import plan  # noqa: E402
from broker.run.pipeline import CloudTarget, Hooks, run_pipeline  # noqa: E402
from tests.conftest import REPO, broker_cmd  # noqa: E402
from tests.providers.aws.test_aws_moto import env, moto_url  # noqa: E402,F401
from tests.support.ec2_spot import SPOT_TERMINATION, EC2SpotFront  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def _recipe(tmp_path: Path):
    work = tmp_path / "recipe"
    shutil.copytree(REPO / "recipes", work, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (work / "r.yaml").write_text(
        "name: aws-spot-preempt\nscript: ddp_train.py\nargs: [--epochs, '40', --resume-dir, ck]\nnodes: 1\n"
        "cpu_ok: true\ntopology: simulated\nbudget_usd: 5\nmax_hours: 0.2\ndisk_gib: 40\n"
        "interruptible: true\ncheckpoint_dir: ck\ncheckpoint_every_s: 1\n"
        "env: {DDP_TIMEOUT_S: '60', PYTHONWARNINGS: ignore}\nexpect: ['DDP_OK']\n")
    return load_recipe(work / "r.yaml")


def _provider(front: EC2SpotFront, workroot: Path):
    import boto3

    from broker.providers.aws import AWSProvider

    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                    region_name="us-east-1")
    # the netns hosts' login user is the Deep Learning AMI's (ubuntu, passwordless sudo; root cannot log in)
    return AWSProvider(session=session, endpoint_url=front.url, region="us-east-1", ssh_user="ubuntu")


def _spot_price(instance_type: str) -> str | None:
    from broker.providers.aws.offers import list_price

    lp = list_price(instance_type)
    return None if lp is None else f"{lp * 0.35:.4f}"  # about what spot costs (moto's is a placeholder)


def _preempt(front: EC2SpotFront, ledger: Ledger, times: int, done: list[str]) -> None:
    """EC2 takes the newest spot instance back once the run has copied a checkpoint generation newer than at the
    last interruption (the job is mid-run), ``times`` times."""
    from broker.run.checkpoint import latest_generation

    seen = None
    deadline = time.monotonic() + 300
    while len(done) < times and time.monotonic() < deadline:
        runs = ledger.list_runs()
        gen = latest_generation(Path(runs[0].run_dir)) if runs and runs[0].run_dir else None
        with front.lock:
            fresh = [i for i in front.host_of if i not in front.interrupted]
        if gen is not None and gen.name != seen and len(fresh) == 1 and len(front.host_of) == len(done) + 1:
            front.interrupt(fresh[0])
            done.append(fresh[0])
            seen = gen.name
        time.sleep(0.05)


@pytest.fixture
def spot_run(moto_url, env, netns_hosts, tmp_path, monkeypatch):  # noqa: F811
    """``go(preemptions, hosts, teardown=False)``: the recipe run against the front, EC2 interrupting the running
    spot instance ``preemptions`` times mid-run (and, with ``teardown``, the last one as broker terminates it);
    returns (pipeline outcome, front, ledger, interrupted ids, progress lines)."""
    fronts: list[EC2SpotFront] = []

    def go(preemptions: int, n_hosts: int, teardown: bool = False):
        hosts = netns_hosts(n_hosts, login_user="ubuntu")
        front = EC2SpotFront(moto_url, hosts, tmp_path / "node-work", spot_price=_spot_price).__enter__()
        fronts.append(front)
        from broker.core.config import settings

        # any image moto holds (it has no Deep Learning AMI to find by name)
        monkeypatch.setenv("AWS_AMI_ID", front.moto().describe_images(Owners=["amazon"])["Images"][0]["ImageId"])
        settings.cache_clear()
        front.interrupt_on_terminate = teardown
        prov = _provider(front, tmp_path / "node-work")
        recipe = _recipe(tmp_path)
        req = recipe.requirements()
        offers = prov.offers(req)  # live spot prices per zone through the front; moto models no EC2 quotas
        options = [o for o in plan(req, offers, [], prov.capacity(offers), now=utcnow()).options if o.valid]
        assert options and options[0].interruptible, [o.label for o in options[:3]]
        ledger = Ledger()
        done: list[str] = []
        t = threading.Thread(target=_preempt, args=(front, ledger, preemptions, done), daemon=True)
        t.start()
        said: list[str] = []
        target = CloudTarget(recipe, options[:4], providers={"aws": prov}, poll_s=0.2, ready_timeout_s=60)
        t0 = time.monotonic()
        out = run_pipeline(recipe, target, ledger=ledger,
                           hooks=Hooks(say=lambda m: said.append(f"{time.monotonic() - t0:6.1f}s {m}")))
        t.join(timeout=5)
        return out, front, prov, ledger, done, said

    try:
        yield go
    finally:
        for f in fronts:
            f.__exit__(None, None, None)


def _check(out, front, prov, ledger, done, said, causes, cli_env):
    from broker.run.attempts import attempt_costs

    log = Path(out.run.run_dir, "node0.log").read_text()
    assert out.exit_code == 0, (out.result and out.result.reason, said[-15:], log[-1500:])
    assert int(log.split("resumed_from_epoch=")[1].split()[0]) > 0, log[-1500:]
    attempts = ledger.attempts(out.run.id)
    assert [a["cause"] for a in attempts] == causes, said[-15:]
    assert all("spot interruption" in a["detail"] and SPOT_TERMINATION[0] in a["detail"]
               for a in attempts if a["cause"] == "preempted"), attempts
    rows = {r.id: r for r in ledger.resources(out.run.id)}
    iids = [next(rows[i].provider_id for i in a["resource_ids"] if rows[i].kind == "instance") for a in attempts]
    assert len(set(iids)) == len(causes) and iids[:len(done)] == done
    # every attempt's instance: terminated per EC2 itself (moto), and the ledger row confirmed terminated
    for iid in iids:
        assert prov.describe_instance(iid).state == "terminated"
        assert front.moto().describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0][
            "State"]["Name"] == "terminated"
    assert all(r.state == "terminated" for r in rows.values()) and ledger.resources(out.run.id, live_only=True) == []
    assert out.left == [] and not [t for t in prov.list_tagged(out.run.id)]
    assert not set(iids) & set(front.live())
    costs = attempt_costs(ledger, out.run.id)
    assert [a["cause"] for a in costs] == causes and all(a["usd"] > 0 for a in costs), costs
    cp = subprocess.run(broker_cmd("cost", "--json"), env=cli_env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-2000:]
    [mine] = [r for r in json.loads(cp.stdout)["runs"] if r["run"] == out.run.id]
    assert [a["cause"] for a in mine["attempts"]] == causes and all(a["usd"] > 0 for a in mine["attempts"]), mine
    assert abs(sum(a["usd"] for a in mine["attempts"]) - mine["usd"]) < 1e-5, mine
    return log


def test_spot_interruption_mid_run_rents_again_and_resumes(spot_run, cli_env):
    out, front, prov, ledger, done, said = spot_run(1, 2)
    _check(out, front, prov, ledger, done, said, ["preempted", "succeeded"], cli_env)
    assert prov.preemption(done[0]).startswith("spot interruption: " + SPOT_TERMINATION[0])
    assert any("attempt 1 preempted" in s for s in said) and any("resumes from checkpoint" in s for s in said)


def test_spot_interrupted_twice_in_a_row_then_during_teardown(spot_run, cli_env):
    """Preempted twice in a row (each attempt mid-run, after it copied a new checkpoint), then EC2 takes the third
    instance back just as broker terminates it after the job succeeded: the run is done, not rented again."""
    out, front, prov, ledger, done, said = spot_run(2, 3, teardown=True)
    _check(out, front, prov, ledger, done, said, ["preempted", "preempted", "succeeded"], cli_env)
    last = ledger.attempts(out.run.id)[-1]
    last_iid = next(r.provider_id for r in map(ledger.resource, last["resource_ids"]) if r.kind == "instance")
    assert last_iid in front.interrupted and prov.preemption(last_iid)  # EC2's word: it was interrupted ...
    assert out.run.status == "succeeded"  # ... but only after the job had succeeded
    assert len(front.host_of) == 3  # no fourth instance
