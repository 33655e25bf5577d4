"""A ledger row is data: a crafted ``local_node`` row (provider ``local``) whose attrs name a program, a folder and a
pid outside the home makes neither ``broker down RUN --yes`` nor the watchdog run, delete or signal anything; the
row is named as damaged and skipped.  Real SQLite file, real processes, real signals."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from broker.core.model import utcnow
from broker.core.records import Resource, Run
from broker.core.rowattrs import AttrsRefused, check_attrs, tunnel_iface
from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

RUN_ID = "20261206-000000-c0ffee"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def crafted(tmp_path, broker_home):
    """The exact case: a running hybrid run whose ``local_node`` row names a canary program as ``python``, a folder
    outside the home as ``keys`` and a pid file holding a live unrelated process's pid."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    mark = tmp_path / "canary-ran"
    canary = tmp_path / "canary"
    canary.write_text(f"#!/bin/sh\ntouch {mark}\n")
    canary.chmod(0o755)
    probe = tmp_path / "probe.py"
    probe.write_text("")
    sleeper = subprocess.Popen(["sleep", "300"])
    (victim / "node0.conf.pid").write_text(str(sleeper.pid))
    job = tmp_path / "torchrun.pid"
    job.write_text(str(sleeper.pid))
    lg = Ledger(broker_home / "ledger.sqlite")
    now = utcnow()
    run_dir = broker_home / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    lg.create_run(Run(id=RUN_ID, name="crafted", provider="local", topology="hybrid", status="running",
                      created_at=now - timedelta(hours=2), deadline=now - timedelta(hours=1), run_dir=str(run_dir)))
    rid = lg.record_intent(RUN_ID, "local", "local_node", "node0").id
    lg.mark_created(rid, "node0", state="running")
    lg.close()
    attrs = {"run_id": RUN_ID, "mesh": "wireguard", "python": str(canary), "probe": str(probe),
             "job_pidfile": str(job), "iface": "bkcanary0", "pidfile": str(victim / "node0.conf.pid"),
             "keys": str(victim)}
    with sqlite3.connect(broker_home / "ledger.sqlite") as db:  # what another local user's edit would write
        db.execute("UPDATE resources SET attrs = ? WHERE id = ?", (json.dumps(attrs), rid))
    yield {"victim": victim, "mark": mark, "sleeper": sleeper, "rid": rid}
    sleeper.kill()
    sleeper.wait()


def _untouched(c: dict) -> None:
    assert not c["mark"].exists(), "the row's program was run"
    assert (c["victim"] / "precious.txt").read_text() == "keep me\n", "a folder outside the home was touched"
    assert (c["victim"] / "node0.conf.pid").exists()
    assert c["sleeper"].poll() is None and _alive(c["sleeper"].pid), "the row's pid was signalled"


def test_down_runs_deletes_and_signals_nothing_a_crafted_local_node_row_names(crafted, cli_env):
    r = subprocess.run(broker_cmd("down", RUN_ID, "--yes"), cwd=REPO, env=cli_env, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    _untouched(crafted)
    assert "damaged ledger row" in r.stderr and RUN_ID in r.stderr and crafted["rid"] in r.stderr, r.stderr
    assert "attrs." in r.stderr, r.stderr


def test_the_watchdog_pass_skips_the_crafted_row(crafted, capsys):
    from broker.money.watchdog import Watchdog

    lg = Ledger()
    try:
        Watchdog(lg, providers={}, ended_grace_s=0.0, confirm_timeout_s=1.0).run_once()
    finally:
        lg.close()
    _untouched(crafted)
    err = capsys.readouterr().err
    assert "damaged ledger row" in err and crafted["rid"] in err, err


def test_the_removal_itself_refuses_what_a_row_names_outside_the_run(crafted):
    """Defence at the boundary: local_node_down re-checks what it is handed (release passes attrs from memory)."""
    from broker.core.provider import BadInput
    from broker.run.hybrid import local_node_down

    attrs = json.loads(sqlite3.connect(Ledger().path).execute(
        "SELECT attrs FROM resources WHERE id = ?", (crafted["rid"],)).fetchone()[0])
    with pytest.raises(BadInput, match="refused"):
        local_node_down(attrs)
    _untouched(crafted)


# --------------------------------------------------------------------------------------------------- the schema
def _honest_local(runs: Path) -> dict:
    folder = runs / RUN_ID
    return {"run_id": RUN_ID, "mesh": "wireguard", "job_pidfile": f"{folder}/here/{RUN_ID}/node0/torchrun.pid",
            "probe": f"{folder}/here/{RUN_ID}/node0/probe.py", "python": sys.executable, "iface": tunnel_iface(RUN_ID),
            "pidfile": f"{folder}/wg/node0.conf.pid", "keys": f"{folder}/wg", "subnet": "198.18.7.0/24",
            "how": "wireguard-go"}


def test_what_broker_writes_validates_and_older_rows_still_do(tmp_path):
    runs = tmp_path / "runs"
    honest = _honest_local(runs)
    assert check_attrs("local_node", RUN_ID, honest, runs=runs) == honest
    older = {k: honest[k] for k in ("keys", "iface", "pidfile")}  # a row of an older broker: no run_id, no probe
    assert check_attrs("local_node", RUN_ID, older, runs=runs) == older
    assert check_attrs("netns_node", RUN_ID, {"cid": "bkn0a1b2c", "hybrid": True}) is not None
    assert check_attrs("slurm_job", RUN_ID, {"host": "alice@login.example.org", "cluster": RUN_ID,
                                             "script": "/home/alice/job.sbatch"})
    assert check_attrs("instance", RUN_ID, {"public_ip": "not an address", "storage_usd_per_hour": 0.01})


@pytest.mark.parametrize("kind,field,value", [
    ("local_node", "python", "/bin/sh"),
    ("local_node", "probe", "/tmp/probe.py"),
    ("local_node", "keys", "{runs}/20261206-000000-0ther0/wg"),  # another run's folder
    ("local_node", "keys", "{runs}/" + RUN_ID + "/../../etc"),
    ("local_node", "pidfile", "relative/node0.conf.pid"),
    ("local_node", "iface", "eth0"),
    ("local_node", "iface", "bkwg0ther0"),  # another run's tunnel
    ("local_node", "run_id", "20261206-000000-0ther0"),
    ("local_node", "subnet", "10.0.0.0/8"),
    ("netns_node", "cid", "bkn0a1b2c; reboot"),
    ("slurm_job", "host", "-oProxyCommand=id"),
    ("slurm_job", "cluster", "../x"),
    ("instance", "pidfile", "/run/sshd.pid"),
    ("instance", "python", sys.executable),
    ("slurm_job", "iface", "eth0"),
])
def test_each_field_that_could_command_is_checked(tmp_path, kind, field, value):
    runs = tmp_path / "runs"
    attrs = dict(_honest_local(runs) if kind == "local_node" else {}, **{field: value.format(runs=runs)})
    with pytest.raises(AttrsRefused) as e:
        check_attrs(kind, RUN_ID, attrs, runs=runs)
    assert e.value.field == field


def test_a_resource_row_that_names_such_a_field_does_not_validate(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="attrs.iface"):
        Resource(id="r-1", run_id=RUN_ID, provider="local", kind="local_node", name="node0",
                 attrs={"iface": "eth0"})
    ok = Resource.model_validate({"id": "r-1", "run_id": RUN_ID, "provider": "local", "kind": "local_node",
                                  "name": "node0", "attrs": _honest_local(tmp_path / "runs")},
                                 context={"runs": tmp_path / "runs"})
    assert ok.attrs["iface"] == tunnel_iface(RUN_ID)


def test_a_public_ip_broker_would_not_record_is_not_used():
    from broker.core.rowattrs import row_address

    assert row_address({"public_ip": "203.0.113.9"}, "public_ip") == "203.0.113.9"
    assert row_address({"public_ip": "-oProxyCommand=id"}, "public_ip") is None
    assert row_address({"public_ip": "1.2.3.4:22 evil"}, "public_ip") is None
