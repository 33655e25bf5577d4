"""The spellings SkyPilot and dstack users type first: short forms where they mean what broker means, and the
nearest broker command for the rest."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _broker(cli_env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker", *args], env=cli_env, capture_output=True, text=True,
                          timeout=120)


def test_down_dash_a_is_down_all(cli_env):
    cp = _broker(cli_env, "down", "-a", "--yes")
    assert cp.returncode == 0, cp.stderr
    assert "nothing live" in cp.stdout


def test_status_dash_r_refreshes_as_status_does_by_default(cli_env):
    cp = _broker(cli_env, "status", "-r")
    assert cp.returncode == 0, cp.stderr
    assert "no runs yet" in cp.stdout
    both = _broker(cli_env, "status", "--refresh", "--no-refresh")
    assert both.returncode == 2 and "contradict" in both.stderr


@pytest.mark.parametrize("word, nearest", [("cost-report", "broker cost"), ("attach", "broker logs"),
                                           ("queue", "broker status"), ("cancel", "broker down")])
def test_another_tool_s_command_gets_broker_s_nearest(cli_env, word, nearest):
    cp = _broker(cli_env, word)
    assert cp.returncode == 2
    assert f"did you mean `{nearest}`?" in cp.stderr
