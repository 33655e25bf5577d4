"""The cluster from `broker slurm up` is a run with ledger resources: the watchdog's deadline rule tears it down
(namespaces and every daemon in them) with no CLI involved, and `slurm down` afterwards finds nothing left."""

from __future__ import annotations

import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

try:
    from tests.support.slurm_cluster import why_not_available
except ImportError:  # tests/ imported as a package
    from tests.support.slurm_cluster import why_not_available

from broker.providers import netns

_why = why_not_available() or netns.missing_requirements()
pytestmark = [pytest.mark.netns, pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(_why is not None, reason=f"slurm up tests: {_why}")]


@pytest.fixture
def own_home(monkeypatch):
    """A broker home outside pytest's numbered temp folders (a parallel session may prune those)."""
    from broker.core.config import settings

    home = Path(tempfile.mkdtemp(prefix="broker-slurmup-wd-"))
    monkeypatch.setenv("BROKER_HOME", str(home))
    settings.cache_clear()
    yield home
    settings.cache_clear()
    shutil.rmtree(home, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_watchdog_deadline_tears_the_cluster_down(own_home):
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import UpOptions, down, leftovers, up
    from broker.slurm.render import pid_files
    from broker.money.watchdog import Watchdog

    led = Ledger()
    state = up(UpOptions(provider="netns", nodes=2, max_hours=0.5), ledger=led)
    try:
        pids = [int(Path(f).read_text()) for i in range(2) for f in pid_files(state, i) if Path(f).exists()]
        assert len(pids) == 5 and all(_alive(p) for p in pids)
        run = led.get_run(state.cluster_id)
        assert abs((run.deadline - run.created_at).total_seconds() - 1800) < 5
        wd = Watchdog(led, providers={"netns": netns.NetnsProvider()},
                      clock=lambda: run.deadline + timedelta(seconds=1))
        actions = wd.run_once()
        assert [a.kind for a in actions if a.run_id == run.id].count("terminate") == 2  # node0 and node1
        assert not led.resources(run.id, live_only=True)
        assert led.get_run(run.id).status == "deadline"
        assert not netns.leftovers(state.netns_cid)
        stop = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < stop:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)]
        assert leftovers(state) == []
        assert down(led, state.cluster_id) == []  # idempotent after the watchdog
    finally:
        if netns.leftovers(state.netns_cid):
            netns.remove_cid(state.netns_cid)


def test_a_failed_up_releases_its_nodes_and_records_the_failure(own_home, monkeypatch):
    """A node without a required binary: `up` fails with a sentence naming it, and the namespaces it had acquired
    are gone, the ledger rows terminated, the run recorded as failed."""
    from broker.slurm import cluster as sc
    from broker.money.ledger import Ledger
    from broker.core.provider import ProviderError

    monkeypatch.setattr(sc, "FACTS_CMD", sc.FACTS_CMD.replace("for b in munged",
                                                               "for b in broker-no-such-daemon munged"))
    led = Ledger()
    with pytest.raises(ProviderError, match="broker-no-such-daemon are missing here"):
        sc.up(sc.UpOptions(provider="netns", nodes=2), ledger=led)
    [run] = led.list_runs(limit=10)
    assert run.status == "failed" and run.topology == "slurm-cluster" and "slurm up failed" in run.message
    rows = led.resources(run.id)
    assert len(rows) == 2 and not led.resources(run.id, live_only=True)
    cid = rows[0].attrs["cid"]
    assert not netns.leftovers(cid)
