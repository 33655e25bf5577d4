"""A command broker prints is never split across lines at 80 columns: it goes on its own line, whole (`ssh -F` /
`<path>` / `node0` after `netns up`; `ssh -i` / `<key>` / `root@IP` for a kept run)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace as NS

from broker.cli.cluster import node_line
from broker.cli.lifecycle import commands_in, kept_message
from broker.core.ui import _Console


def _printed(text: str, keep: list[str], width: int = 80) -> str:
    buf = io.StringIO()
    _Console(file=buf, width=width, highlight=False, soft_wrap=True, emoji=False).print(text, markup=False,
                                                                                       keep=keep)
    return buf.getvalue()


def test_netns_up_s_ssh_command_is_printed_whole_at_80_columns():
    c = NS(root=Path("/tmp/pytest-of-root/pytest-12/test_a_long_test_name0/hosts0/bkn1a2b3c"),
           ns=lambda i: f"bkn1a2b3cn{i}")
    text, cmd = node_line(c, NS(node_rank=1, host="198.18.7.11"))
    out = _printed(text, [cmd])
    assert cmd in out.splitlines()[-1], out
    assert any(len(line) > 80 for line in out.splitlines())  # whole, past the width, never split


def test_a_kept_run_s_commands_are_each_printed_whole_at_80_columns():
    node = NS(user="ubuntu", host="203.0.113.7", port=22)
    cluster = NS(nodes=[node], local_exec=False, ssh_key_path="/root/.local/share/broker/runs/r-1/ssh/id_ed25519",
                 known_hosts_path="/root/.local/share/broker/runs/r-1/known_hosts", workroot="/home/ubuntu/work")
    out = NS(run=NS(id="20261206-000000-abcdef"), kept=[NS(provider="aws", provider_id="i-1", name="n0")],
             cluster=cluster)
    for line in kept_message(out, 10):
        cmds = commands_in(line)
        printed = _printed(line, cmds)
        for cmd in cmds:
            assert any(cmd in row for row in printed.splitlines()), (cmd, printed)
