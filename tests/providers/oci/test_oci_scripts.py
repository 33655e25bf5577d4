"""The OCI node scripts run for real in a local shell: host firewall opening (fake firewall-cmd / iptables that
record their arguments) and the instance-principal dead-man switch (a fake instance-metadata service on a local
HTTP server, a fake ``oci`` CLI that records the terminate call, a short timer)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from broker.providers.oci import cloud_init, deadman_cloud_init, deadman_watcher, firewall_script, node_layers

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def fake(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/bin/bash\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def link(bindir: Path, *tools: str) -> None:
    for t in tools:
        real = shutil.which(t)
        assert real, t
        (bindir / t).symlink_to(real)


@pytest.fixture
def bindir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    return d


def run(script: str, bindir: Path, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, "-c", script], env={"PATH": str(bindir), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def test_firewall_opens_vcn_cidr_only(tmp_path, bindir):
    log = tmp_path / "calls.log"
    fake(bindir, "firewall-cmd", f'echo "firewall-cmd $*" >> {log}\n')
    fake(bindir, "iptables", f'if [ "$1" = -C ]; then exit 1; fi\necho "iptables $*" >> {log}\n')
    fake(bindir, "iptables-save", 'echo "-A INPUT -s 10.0.0.0/16 -j ACCEPT"\n')
    rules = tmp_path / "rules.v4"
    rules.write_text("old\n")
    r = run(firewall_script("10.0.0.0/16", rules_v4=str(rules)), bindir)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls == ["firewall-cmd --state",
                     "firewall-cmd --permanent --zone=trusted --add-source=10.0.0.0/16",
                     "firewall-cmd --reload",
                     "iptables -I INPUT 1 -s 10.0.0.0/16 -j ACCEPT"]
    assert "10.0.0.0/16" in rules.read_text()  # persisted where the image keeps its rules


def test_firewall_iptables_fallback_is_idempotent(tmp_path, bindir):
    log = tmp_path / "calls.log"
    # no firewall-cmd; the ACCEPT rule already exists (-C succeeds): nothing inserted twice
    fake(bindir, "iptables", f'echo "iptables $*" >> {log}\n')
    r = run(firewall_script("10.0.0.0/16", rules_v4=str(tmp_path / "absent")), bindir)
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == ["iptables -C INPUT -s 10.0.0.0/16 -j ACCEPT"]


def test_deadman_fires_after_deadline_with_instance_principal(tmp_path, bindir, own_httpserver):
    log = tmp_path / "oci.log"
    count = tmp_path / "count"
    # the fake oci CLI fails once (e.g. token not ready), then succeeds: the watcher retries
    fake(bindir, "oci", f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}\n'
                        f'echo "$(date +%s) $*" >> {log}\n[ "$n" -ge 1 ]\n')
    link(bindir, "curl", "date", "sleep", "cat")
    srv = own_httpserver
    srv.expect_request("/opc/v2/instance/id", method="GET", headers={"Authorization": "Bearer Oracle"}) \
        .respond_with_data("ocid1.instance.oc1..self")
    fire_at = int(time.time()) + 2
    script = deadman_watcher(fire_at, region="us-ashburn-1")
    r = run(script, bindir, env={"BROKER_IMDS": srv.url_for("").rstrip("/"), "BROKER_DEADMAN_POLL_S": "0.2",
                                  "BROKER_DEADMAN_RETRY_S": "0.1"})
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == 2  # one failure, one retry that succeeded, then the watcher exits
    for line in lines:
        ts, args = line.split(" ", 1)
        assert int(ts) >= fire_at  # never before the deadline + grace
        assert args.split() == ["compute", "instance", "terminate", "--instance-id", "ocid1.instance.oc1..self",
                                "--preserve-boot-volume", "false", "--force", "--auth", "instance_principal",
                                "--region", "us-ashburn-1"]


def test_deadman_install_snippet(tmp_path, bindir):
    log = tmp_path / "systemd-run.log"
    fake(bindir, "oci", "exit 0\n")
    fake(bindir, "systemd-run", f'echo "$*" >> {log}\n')
    link(bindir, "cat", "chmod")
    target = tmp_path / "broker-deadman"
    deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
    snippet = deadman_cloud_init(deadline, 300, install_path=str(target))
    r = run(snippet, bindir)
    assert r.returncode == 0, r.stderr
    assert target.read_text() == deadman_watcher(int(deadline.timestamp()) + 300)
    assert os.access(target, os.X_OK)
    assert log.read_text().split() == ["--unit=broker-deadman", "--property=Restart=on-failure", str(target)]


def test_cloud_init_is_valid_bash():
    ud = cloud_init("10.0.0.0/16", deadline=datetime(2030, 1, 1, tzinfo=timezone.utc), instance_principal=True,
                    onstart="echo ready")
    r = subprocess.run([BASH, "-n"], input=ud, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert "broker-deadman" not in cloud_init("10.0.0.0/16", deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


def test_node_layers():
    assert node_layers(False) == ["cli", "watchdog"]
    assert node_layers(True) == ["cli", "watchdog", "node"]
    from broker.providers.oci import OCIProvider

    assert OCIProvider(instance_principal=True).armed_layers() == ["cli", "watchdog", "node"]
    assert OCIProvider(instance_principal=False).armed_layers() == ["cli", "watchdog"]
