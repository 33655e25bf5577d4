"""`broker run RECIPE --provider netns --cluster ID` runs on the cluster `broker netns up` made (it built a second
one, and `--cluster` said "works with --provider slurm only")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli.test_run_script import TINY_DDP


@pytest.mark.netns
def test_run_on_a_kept_netns_cluster_by_its_cluster_id(cli_env, tmp_path):
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.money.ledger import Ledger
    from broker.providers import netns

    def cli(*args, timeout=240):
        return subprocess.run([sys.executable, "-m", "broker", *args], env=cli_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    (tmp_path / "tiny_ddp.py").write_text(TINY_DDP)
    (tmp_path / "r.yaml").write_text("name: tiny\nscript: tiny_ddp.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.2\n")
    up = cli("netns", "up", "2", "--hours", "0.5", "--json")
    assert up.returncode == 0, up.stderr
    data = json.loads(up.stdout)
    cid, run_id = data["cid"], data["run_id"]
    try:
        r = cli("run", "r.yaml", "--provider", "netns", "--cluster", cid)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "[node 1] RANK=1 sum=3" in r.stdout and f"nodes of {run_id} still kept" in r.stdout
        led = Ledger()
        try:  # no second cluster was built: the only netns nodes are the kept cluster's
            assert {x.provider_id for x in led.resources(live_only=True) if x.provider == "netns"} == \
                {f"{cid}:0", f"{cid}:1"}
        finally:
            led.close()
        bad = cli("run", "r.yaml", "--provider", "netns", "--cluster", "bkn000000")
        assert bad.returncode == 2 and "no netns cluster bkn000000" in bad.stderr, bad.stderr
        bad = cli("run", "r.yaml", "--provider", "netns", "--cluster", "nope")
        assert bad.returncode == 2 and "no netns cluster" in bad.stderr and "netns status" in bad.stderr
    finally:
        cli("netns", "down", cid)
        assert netns.leftovers(cid) == []
