"""The live status line on a real terminal (a pty, 80 columns, read through a terminal emulator): it never wraps
("network checks[preflight] check nod" ran into the next line in tmux) and never stays behind on the screen once
the run's header is printed (a stale spinner line after the quick start)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import termios
import time

import pytest

pyte = pytest.importorskip("pyte")

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def test_the_live_line_is_cut_to_one_line_of_the_terminal():
    from broker.cli.lifecycle import ProgressPrinter
    from broker.core.ui import _Console

    con = _Console(width=80, force_terminal=False)
    p = ProgressPrinter(ledger=None, console=con)
    p.step = "preflight: network checks between every pair of nodes on the master port and an ephemeral port " * 2
    text = p._text()
    assert text.cell_len <= 77 and text.plain.endswith("…")


def test_output_printed_while_the_live_line_runs_leaves_no_stale_spinner():
    """The run's header went to stdout while stderr's live line was up: the spinner line stayed on the screen and
    the header was cut ("⠴ [ 0.4s ...] plan: ... v…r" / "un 2026..."). Printed through ``paused()`` it is clean."""
    import select as sel

    from broker.cli.lifecycle import ProgressPrinter
    from broker.core.ui import _Console

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 80, 0, 0))
    f = os.fdopen(slave, "w", buffering=1)
    err = _Console(file=f, force_terminal=True, width=80, stderr=True)
    out = _Console(file=f, force_terminal=True, width=80)
    p = ProgressPrinter(ledger=None, console=err)
    try:
        p("plan: this machine (free) is the cheapest of 39 valid options")
        time.sleep(0.3)  # the live line is drawn and refreshing
        with p.paused():
            out.print("run 20261206-000000-abcdef: ddp-2node, 2 nodes", highlight=False)
        time.sleep(0.3)
        p("staging the work folder on every node")
        time.sleep(0.3)
    finally:
        p.close()
        f.flush()
    screen = pyte.Screen(80, 30)
    stream = pyte.ByteStream(screen)
    while sel.select([master], [], [], 0.3)[0]:
        stream.feed(os.read(master, 65536))
    f.close()
    os.close(master)
    shown = [line.rstrip() for line in screen.display if line.strip()]
    assert not any(ch in line for line in shown for ch in SPINNER), shown
    assert "run 20261206-000000-abcdef: ddp-2node, 2 nodes" in shown, shown
