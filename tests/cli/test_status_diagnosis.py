"""`broker status RUN` of a failed run carries the run's diagnosis (cause and fix, from <run>/diagnosis.txt that
the diagnose step wrote), and for a background run (`broker run -d`) names the file its output went to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from broker.cli.app import app
from broker.money.ledger import Ledger
from tests.support.watchdog_helpers import make_run

CPU = Path(__file__).resolve().parents[1] / "diagnose_logs" / "cpu"


def _failed_no_torch_run(home: Path):
    led = Ledger(home / "ledger.sqlite")
    run = make_run(led, status="failed")
    folder = home / "runs" / run.id
    shutil.copytree(CPU / "no_torch", folder)
    led.update_run(run.id, run_dir=str(folder), message="node 0 exited with code 1; stopped the other nodes")
    r = json.loads((folder / "result.json").read_text())
    res = SimpleNamespace(ok=False, error_lines=[], status=r["status"],
                          exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                          log_paths={int(p.stem[4:]): p for p in folder.glob("node*.log")}, diagnosis=[])
    from broker.run.pipeline import diagnose

    diagnose(res, SimpleNamespace(nodes=2), folder)  # the pipeline's own step writes diagnosis.txt
    return led, run


def test_status_run_shows_the_cause_and_fix_and_the_background_output(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    from broker.core import ui
    monkeypatch.setattr(ui.console, "_width", 200)
    led, run = _failed_no_torch_run(tmp_path)
    (tmp_path / "logs").mkdir()
    out_file = tmp_path / "logs" / f"run-{run.id}.out"
    out_file.write_text("broker: ...\n")
    res = CliRunner().invoke(app, ["status", run.id, "--no-refresh"])
    assert res.exit_code == 0, res.output
    assert "stopped the other nodes" in res.output
    assert "cause [torch-missing]" in res.output and "fix:" in res.output
    assert str(out_file) in res.output
    listing = CliRunner().invoke(app, ["status", "--no-refresh"])
    assert listing.exit_code == 0, listing.output
    assert f"{run.id} failed: cause [torch-missing]" in " ".join(listing.output.split())
    data = json.loads(CliRunner().invoke(app, ["status", run.id, "--no-refresh", "--json"]).output)
    assert any(ln.startswith("cause [torch-missing]") for ln in data["diagnosis"])
    led.close()


def test_a_row_naming_a_folder_elsewhere_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    led = Ledger(tmp_path / "ledger.sqlite")
    run = make_run(led, status="failed")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "diagnosis.txt").write_text("cause [secret]: not this run's\n")
    led.update_run(run.id, run_dir=str(other))
    res = CliRunner().invoke(app, ["status", run.id, "--no-refresh"])
    assert "not this run's" not in res.output
    led.close()
