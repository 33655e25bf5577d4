"""`broker run recipes/ddp_spot.yaml` without cloud credentials ends at exit 4 (a provider that is not
configured, as with `--provider`) with the free ways to try it
(`--provider local` here, `broker plan --recipe` for the interruptible option); `--provider local` on an
interruptible: true recipe says once that interruptible does not apply on this machine."""

from __future__ import annotations

import subprocess

from broker.core.recipe import load_recipe
from broker.run.pipeline import RunRequest, choose_target
from tests.conftest import REPO, broker_cmd

CLOUD_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "VAST_API_KEY", "OCI_CONFIG_FILE",
              "OCI_PROFILE", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG")


def test_no_credentials_hint_names_the_free_ways_to_try_it(cli_env, tmp_path):
    env = {k: v for k, v in cli_env.items() if k not in CLOUD_VARS}
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), OCI_CONFIG_FILE=str(tmp_path / "none"))
    p = subprocess.run(broker_cmd("run", "recipes/ddp_spot.yaml"), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    text = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 4, text
    assert "credentials check failed" in text and "no provider with credentials can serve ddp-spot" in text
    assert "`broker run recipes/ddp_spot.yaml --provider local`" in text and "nothing is preempted" in text
    assert "`broker plan --recipe recipes/ddp_spot.yaml` shows the interruptible option" in text


def test_provider_local_says_once_that_interruptible_does_not_apply():
    said: list[str] = []
    choose_target(load_recipe(REPO / "recipes" / "ddp_spot.yaml"), RunRequest(provider="local"), say=said.append)
    notes = [s for s in said if "interruptible" in s]
    assert len(notes) == 1 and "does not apply on this machine" in notes[0], said
    said.clear()
    choose_target(load_recipe(REPO / "recipes" / "ddp_2node.yaml"), RunRequest(provider="local"), say=said.append)
    assert not any("interruptible" in s for s in said), said


def test_provider_netns_says_it_too():
    """The emulated hosts are this machine's too: `--provider netns` dropped interruptible: true silently."""
    said: list[str] = []
    choose_target(load_recipe(REPO / "recipes" / "ddp_spot.yaml"), RunRequest(provider="netns"), say=said.append)
    notes = [s for s in said if "interruptible" in s]
    assert len(notes) == 1 and "does not apply on the emulated hosts (netns) on this machine" in notes[0], said


def test_plan_on_netns_agrees_with_run_for_a_cpu_ok_recipe(cli_env):
    """`broker plan --provider netns` for a cpu_ok recipe rejected the emulated hosts for their GPU memory (0 GiB <
    16 GiB) while `broker run --provider netns` ran it: this machine's CPU counts as for `local`."""
    cli_env = dict(cli_env, COLUMNS="250")
    code, text = _broker(cli_env, "plan", "--recipe", "recipes/ddp_2node.yaml", "--provider", "netns")
    assert code == 0 and "chosen: multi-node on netns" in text and "GPU memory 0 GiB" not in text, text
    code, text = _broker(cli_env, "plan", "--recipe", "recipes/ddp_spot.yaml", "--provider", "netns")
    assert "GPU memory 0 GiB" not in text and "no interruptible price is known for this offer" in text, text
    # a GPU job that does not accept the CPU is still refused there
    code, text = _broker(cli_env, "plan", "--provider", "netns", "--no-cpu-ok")
    assert code == 3 and "chosen:" not in text, text


def _no_cloud_env(cli_env, tmp_path) -> dict[str, str]:
    env = {k: v for k, v in cli_env.items() if k not in CLOUD_VARS}
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), OCI_CONFIG_FILE=str(tmp_path / "none"))
    return env


def _broker(env, *args: str) -> tuple[int, str]:
    p = subprocess.run(broker_cmd(*args), cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=120)
    return p.returncode, " ".join((p.stdout + p.stderr).split())


def test_not_configured_is_exit_4_on_every_command_path(cli_env, tmp_path):
    """A provider that is not configured is a provider error (exit 4, README's table) wherever it stops a
    command: `broker run` planning over every provider, `broker run --topology hybrid`, and `broker slurm up` on a
    cloud for CPU nodes (checked before planning) and for GPU nodes (through the run's plan step).  `broker run`
    without --provider said 3 (no valid plan) although its plan fitted."""
    env = _no_cloud_env(cli_env, tmp_path)
    code, text = _broker(env, "run", "recipes/ddp_2node.yaml", "--topology", "hybrid")
    assert code == 4 and "credentials check failed" in text, text
    for extra in ([], ["--gpus"]):
        code, text = _broker(env, "slurm", "up", "--provider", "aws", "--nodes", "2", "--yes", *extra)
        assert code == 4 and "aws: credentials check failed" in text and "nothing" in text, (extra, text)
