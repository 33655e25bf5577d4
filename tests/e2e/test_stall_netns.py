"""Stall detection over SSH (broker/run/stall.py through broker.run.remote.SSHExecutor): two netns hosts with their own
sshd, a real gloo job where rank 0 waits in all_reduce and rank 1 sleeps; the stacks are read on the nodes
(``rankshim.py --dump-stacks``) and the run is stopped long before its deadline with both places named (root only)."""

from __future__ import annotations

import json
import time

import pytest

from broker.providers import netns

_why = netns.missing_requirements()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"netns tests: {_why}")]

from tests.support.hangs import HANG


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))


def test_a_hang_on_two_ssh_hosts_is_named_and_stopped(tmp_path):
    from broker.run.diagnose import explain
    from broker.core.recipe import load_recipe
    from tests.support.runs import run_remote

    d = tmp_path / "job"
    d.mkdir()
    (d / "train.py").write_text(HANG)
    (d / "r.yaml").write_text("name: hang\nscript: train.py\nnodes: 2\ncpu_ok: true\ngpus_per_node: 0\n"
                              "max_hours: 0.05\nstall_s: 5\n")
    recipe = load_recipe(d / "r.yaml")
    c = netns.up(2, tmp_path / "c", use_gpus=False)
    lines: list[str] = []
    try:
        res = run_remote(c.cluster("stall"), recipe, tmp_path / "run", echo=lines.append)
    finally:
        c.down()
    time.sleep(0.2)
    assert netns.leftovers(c.cid) == [] and netns.sshd_processes(c.cid) == []
    want = "rank 0 waits in all_reduce at train.py:9; rank 1 never called all_reduce: it is in time.sleep at train.py:8"
    assert res.status == "failed" and want in res.reason, (res.reason, lines[-30:])
    st = json.loads((tmp_path / "run" / "stall.json").read_text())
    assert st["stopped"] and [r["node"] for r in st["ranks"]] == [0, 1]
    text = "\n".join(explain(tmp_path / "run", res, 2).lines())
    assert text.startswith(f"stalled: {want}") and "failed first" not in text, text
