"""The "Adding a provider" recipe (docs/architecture.md), followed for a provider that exists only in the tests: a
lab cluster whose hosts are this machine's processes (tests/support/labcluster.py), installed the way a package
outside broker adds one (an entry point of the ``broker.providers`` group), with no edit to broker/.  `broker run
--provider lab` runs a real two-node gloo job through the one pipeline on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_run_script import TINY_DDP

pytestmark = pytest.mark.slow  # a real torchrun job


def _installed(tmp_path: Path) -> Path:
    """A site folder holding the plug-in's distribution metadata: the entry point names the test's adapter."""
    site = tmp_path / "site"
    info = site / "broker_lab-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broker-lab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[broker.providers]\nlab = tests.support.labcluster:LabProvider\n")
    return site


@pytest.fixture
def lab(cli_env, tmp_path):
    env = dict(cli_env, COLUMNS="200")
    env["PYTHONPATH"] = str(_installed(tmp_path)) + ":" + env["PYTHONPATH"]
    (tmp_path / "tiny_ddp.py").write_text(TINY_DDP)
    (tmp_path / "r.yaml").write_text("name: tiny\nscript: tiny_ddp.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.2\n")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "broker", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=240, stdin=subprocess.DEVNULL)

    return cli


def test_a_provider_added_by_an_entry_point_runs_a_job_through_broker_run(lab):
    r = lab("run", "r.yaml", "--provider", "lab", "--option", "lab-queue=long", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["run"]["provider"] == "lab" and out["result"]["status"] == "succeeded", out
    run_dir = Path(out["run"]["run_dir"])
    logs = "".join(p.read_text() for p in sorted(run_dir.glob("**/node*.log")))
    assert "RANK=1 sum=3" in logs, logs
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["queue"] == "long"  # the adapter read its own option
    assert not (run_dir / "lab-reservation.json").exists()  # acquired, then released by the target


def test_the_adapter_checks_its_own_option_and_other_providers_refuse_it(lab):
    bad = lab("run", "r.yaml", "--provider", "lab", "--option", "lab-queue=nope")
    assert bad.returncode == 2 and "--lab-queue 'nope' is not a queue of the lab" in bad.stderr, bad.stderr
    elsewhere = lab("run", "r.yaml", "--provider", "local", "--option", "lab-queue=long")
    assert elsewhere.returncode == 2 and "--lab-queue works with --provider lab only" in elsewhere.stderr, \
        elsewhere.stderr


def test_an_option_no_provider_takes_is_named_as_typed_with_the_options_that_exist(lab):
    r = lab("run", "r.yaml", "--provider", "local", "-o", "foo=bar")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "-o foo: no provider takes an option called 'foo'" in r.stderr, r.stderr
    # the hint lists every provider's options, the plug-in's included
    assert "-o lab-queue=VALUE (lab)" in r.stderr and "-o inject=VALUE (netns)" in r.stderr, r.stderr


def test_plugins_are_not_read_at_start_up(cli_env, tmp_path):
    """The entry points are read the first time a name is not in the registry, never by `broker --help`."""
    code = ("import sys; from broker.cli.app import main; sys.argv = ['broker', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "import broker.providers as r; print('plugins read:', r._plugins is not None)")
    p = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=60)
    assert "plugins read: False" in p.stdout, p.stdout + p.stderr
