"""Money is shown to the cent; more digits only where the cent cannot tell two values apart, and then the text
says so (`broker plan --budget 5` showed "$5.0029" beside "$5.01" with no word why)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rejected_list_explains_its_extra_digits(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), OCI_CONFIG_FILE=str(tmp_path / "none"), HOME=str(tmp_path),
               AWS_EC2_METADATA_DISABLED="true", COLUMNS="250")  # each reason on one line
    def plan(*more: str) -> str:
        out = subprocess.run([sys.executable, "-m", "broker", "plan", "--budget", "5", "--offline", *more], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    import json

    reasons = [r for o in json.loads(plan("--json"))["plan"]["rejected"] for r in o["rejected"]]
    long_digits = [r for r in reasons if re.search(r"\$[1-9][\d,]*\.\d{4}", r)]
    assert long_digits, reasons  # the snapshot has an option $0.0029 over the $5.00 budget
    for r in long_digits:  # the difference itself, not two amounts that read alike ("$5.00 > $5.00")
        assert re.search(r"worst case \$5\.0029 at 1 h is over the \$5\.00 budget by \$0\.0029; affords", r), r
        assert "> budget" not in r and "to the cent" not in r, r
    assert any(re.search(r"worst case \$5\.01 ", r) for r in reasons)  # its neighbour keeps the cent
    text = " ".join(plan().split())
    assert "worst case $5.0029 at 1 h is over the $5.00 budget by $0.0029" in text


def test_digits_note_only_when_the_cent_cannot_tell_them_apart():
    from broker.core.prose import usd
    from broker.plan.planner import digits_note

    assert usd(5.0029, 5.0) == "$5.0029" and digits_note(5.0029, 5.0) == " (over it by $0.0029)"
    assert usd(5.01, 5.0) == "$5.01" and digits_note(5.01, 5.0) == ""
    assert digits_note(5.0, 5.0) == "" and digits_note(0.004, 0.003) == ""  # sub-cent values always show 4 digits
    # the planner's formatter showed $5.0000 for an amount equal to its budget; equal amounts need no extra digits
    assert usd(5.0, 5.0) == "$5.00"
    assert usd(5.0029) == "$5.00" and usd(0.005) == "$0.0050"
