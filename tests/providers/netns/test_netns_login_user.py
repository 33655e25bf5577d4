"""netns hosts that behave like a cloud image (the emulators' VMs): the image's login user with passwordless sudo
and its own home, root login refused, this machine's Python usable by that user."""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.netns]


def test_login_user_has_passwordless_sudo_and_root_cannot_log_in(netns_hosts):
    c = netns_hosts(1, login_user="opc")
    base = ["ssh", "-i", str(c.key_path), "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={c.known_hosts}",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    p = subprocess.run(base + [f"opc@{c.ip(0)}", "id -un; sudo -n id -u; echo $HOME; python3 -c 'import torch'"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["opc", "0", "/home/opc"], (p.stdout, p.stderr)
    p = subprocess.run(base + [f"root@{c.ip(0)}", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 255 and "Permission denied" in p.stderr, p.stderr
    assert c.cluster("r").nodes[0].user == "opc"
