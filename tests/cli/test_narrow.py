"""Readable at 80 columns: `broker plan` and `broker check` fit an 80-column terminal without cutting
what a user must read or copy (no '…'), and `--wide` brings the full plan table back."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from rich.cells import cell_len

from tests.conftest import REPO, broker_cmd


@pytest.fixture(autouse=True)
def wrapping_on(broker_home, monkeypatch):
    """This file checks the wrapping itself: BROKER_NO_WRAP (set for the rest of the suite) is off here."""
    monkeypatch.delenv("BROKER_NO_WRAP", raising=False)


def _out(args, env, columns=80):
    p = subprocess.run(broker_cmd(*args), cwd=REPO, env=dict(env, COLUMNS=str(columns)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _table_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(" ") or "─" in ln]


def test_plan_fits_80_columns_and_cuts_nothing(cli_env):
    out = _out(["plan", "--budget", "5"], cli_env)
    assert "…" not in out
    assert all(cell_len(ln) <= 80 for ln in _table_lines(out)), [ln for ln in _table_lines(out) if cell_len(ln) > 80]
    assert re.search(r"^ \*\s+vast\s+simulated\s+2x RTX 3090\s+24G\s+\$0\.34", out, re.M), out
    assert "--wide adds" in out
    wide = _out(["plan", "--budget", "5", "--wide"], cli_env, columns=160)
    assert "snap 11-29" in wide and "Quebec" in wide


def test_check_shows_urls_and_key_paths_whole_at_80_columns(cli_env):
    out = _out(["check"], cli_env)
    assert "…" not in out
    assert "https://cloud.vast.ai/manage-keys/" in out and "~/.config/vastai/vast_api_key" in out
    assert "~/.oci/config" in out


def test_names_with_colons_print_as_written():
    """A recipe or offer name like ``demo:fire:`` is printed as written, not turned into an emoji by rich."""
    from broker.core.ui import console, err

    for c in (console, err):
        with c.capture() as cap:
            c.print("run demo:fire: on node:rocket:1")
        assert "demo:fire: on node:rocket:1" in cap.get()


def _rejected_cells(text: str) -> tuple[list[str], list[str]]:
    """The lines of the rejected table's two columns (option, why) at 80 columns."""
    lines = text.split("\nrejected\n", 1)[1].splitlines()
    head = next(i for i, ln in enumerate(lines) if "why" in ln and "option" in ln)
    at = lines[head].index("why")
    body = []
    for ln in lines[head + 2:]:
        if not ln.strip():
            break
        body.append(ln)
    return [ln[:at].strip() for ln in body], [ln[at:].strip() for ln in body]


@pytest.mark.parametrize("args", [["plan", "--budget", "5"], ["plan", "--nodes", "2", "--topology", "hybrid", "--cpu-ok"]])
def test_rejected_reasons_wrap_without_a_lone_word(cli_env, args):
    out = _out(args, cli_env)
    option, why = _rejected_cells(out)
    assert len(why) >= 10, out
    lone = [w for w in why if len(w.split()) == 1]
    assert not lone, (lone, out)
    # the option column: a lone piece is only the worst case on its own line, e.g. "($0.43)"
    assert all(len(o.split()) != 1 or re.fullmatch(r"\(\$[\d.,]+\)|\(-\)", o) for o in option), option


def test_wrap_words_keeps_breaks_and_moves_a_widow():
    from broker.core.ui import wrap_words

    assert wrap_words("worst case $5.01 at 1 h > budget $5.00; affords 0.99 h", 52) == [
        "worst case $5.01 at 1 h > budget $5.00; affords", "0.99 h"]
    assert wrap_words("a b\n-> do this", 80) == ["a b", "-> do this"]
    assert wrap_words("one two", 3) == ["one", "two"]  # two words: nothing to give
    assert wrap_words("x" * 10 + " y", 5) == ["x" * 10, "y"]  # a word wider than the cell keeps its own line


# ------------------------------------------------------------------------------------------------ every line fits
def _too_wide(text: str, width: int = 80) -> list[str]:
    """Lines wider than ``width`` cells, except a node's streamed log line (verbatim by design) and a line that is
    one unbreakable piece (a path, URL or `backticked` command longer than the width keeps a line of its own)."""
    bad = []
    for ln in text.splitlines():
        if cell_len(ln) <= width or ln.startswith("[node "):
            continue
        piece = ln.strip()
        if " " not in piece or re.fullmatch(r"`[^`]+`[,;.)]?", piece):
            continue
        bad.append(ln)
    return bad


def _failing_job(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(
        "import os\nprint('rank', os.environ.get('RANK'), 'says ' + 'a long line of its own log ' * 6, flush=True)\n"
        "if os.environ.get('RANK') == '1':\n    raise RuntimeError('boom: simulated failure on rank 1 of the job')\n")
    (job / "r.yaml").write_text("name: a-failing-job-with-a-rather-long-name\nscript: train.py\nnodes: 2\n"
                                "cpu_ok: true\nmax_hours: 0.1\n")
    for d in (".git", ".aws", ".ssh", ".oci", "data"):
        (job / d).mkdir()
    for f in (".env", ".env.local", "a.pem", "b.key", "id_rsa", "data/skip.bin", ".gitignore"):
        (job / f).write_text("data/\n" if f == ".gitignore" else "x")
    return job / "r.yaml"


@pytest.mark.parametrize("args", [["plan", "--budget", "5"], ["plan", "--nodes", "2", "--topology", "hybrid",
                                                                   "--cpu-ok"],
                                  ["check"], ["offers", "--limit", "60"], ["status"], ["run", "--help"],
                                  ["netns", "down", "--help"], ["--json", "status"], ["run", "--budget", "5", "x"],
                                  ["quota", "status", "--nodes", "3"],
                                  ["plan", "--recipe", "no-such.yaml"]])
def test_every_line_fits_80_columns(cli_env, args):
    p = subprocess.run(broker_cmd(*args), cwd=REPO, env=dict(cli_env, COLUMNS="80"), capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in p.stderr
    assert "…" not in p.stdout + p.stderr
    assert not _too_wide(p.stdout), _too_wide(p.stdout)
    assert not _too_wide(p.stderr), _too_wide(p.stderr)


@pytest.mark.slow
def test_a_failing_run_fits_80_columns_and_lists_what_was_not_staged(cli_env, tmp_path):
    recipe = _failing_job(tmp_path)
    env = dict(cli_env, COLUMNS="80")
    p = subprocess.run(broker_cmd("run", str(recipe)), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert not _too_wide(p.stdout), _too_wide(p.stdout)
    assert not _too_wide(p.stderr), _too_wide(p.stderr)
    # the node's own long line is streamed verbatim, whole
    assert any(ln.startswith("[node 0] rank 0 says ") and cell_len(ln) > 80 for ln in p.stdout.splitlines())
    # the screen keeps the short form and says where the full list is
    flat = " ".join(p.stderr.split())
    assert "(not copied: .aws/, .env, .env.local, .git/, .oci/, .ssh/, ...)" in flat, p.stderr
    m = re.search(r"full list: (\S+/staged\.txt)", flat)
    assert m, p.stderr
    listed = Path(m[1]).read_text()
    for name in (".aws/", ".env", ".env.local", ".git/", ".oci/", ".ssh/", "a.pem", "b.key", "id_rsa", "data/"):
        assert f"\n{name}\n" in listed, listed
    assert "\ntrain.py\n" in listed and "\nr.yaml\n" in listed
    # -v logs the size and the whole list
    v = subprocess.run(broker_cmd("-v", "run", str(recipe)), cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=240)
    assert v.returncode == 1
    assert re.search(r"INFO broker\.run\.executor: staging 3 file\(s\), \d+ B \(\d+ bytes\) per node", v.stderr), v.stderr
    assert "not copied to the nodes (10): .aws/, .env, .env.local, .git/, .oci/, .ssh/, a.pem, b.key, data/, id_rsa" \
        in v.stderr, v.stderr
    assert "INFO broker.run.executor: step stage" in v.stderr and "INFO broker.run.executor: step launch" in v.stderr
    assert re.search(r"INFO broker\.money\.ledger: ledger: run \S+ start by cli", v.stderr), v.stderr
    assert "INFO broker.run.pipeline: run " in v.stderr
    assert v.stdout.count("[node 1] RuntimeError: boom") == 1


def test_offers_at_80_columns_keeps_ids_and_network_whole(cli_env):
    out = _out(["offers", "--limit", "100"], cli_env)
    assert "…" not in out
    assert re.search(r"^ oci\s+BM\.GPU\.A100-v2\.8\s+8x A100-80GB 80G\s+\$32\.00\s+any\s+private\s*$", out, re.M), out
    assert re.search(r"^ vast\s+snapshot\s+.*\spublic\s*$", out, re.M)
    assert "--wide adds vCPU/RAM and disk prices" in " ".join(out.split())
    wide = _out(["offers", "--limit", "100", "--wide"], cli_env, columns=160)
    assert "vCPU/RAM GiB" in wide and "disk $/GiB/mo" in wide


def test_help_keeps_hyphenated_values_and_has_no_rst_markup(cli_env):
    out = _out(["run", "--help"], cli_env)
    assert "direct-blocked" in out and "direct-\n" not in out
    out = _out(["netns", "down", "--help"], cli_env)
    assert "``" not in out and "'bkn' + 6 hex digits" in " ".join(out.split())


def test_prose_wraps_at_words_and_never_inside_a_command_url_or_path():
    from broker.core.ui import wrap_plain

    text = ("-> set VAST_API_KEY (environment or .env) or save the key from https://cloud.vast.ai/manage-keys/ to "
            "~/.config/vastai/vast_api_key (`vastai set api-key ...`)")
    lines = wrap_plain(text, 50)
    assert all(cell_len(ln) <= 50 for ln in lines), lines
    assert any("https://cloud.vast.ai/manage-keys/" in ln for ln in lines)
    assert any("~/.config/vastai/vast_api_key" in ln for ln in lines)
    assert any("`vastai set api-key ...`" in ln for ln in lines)
    assert all(ln.startswith("   ") for ln in lines[1:])  # hanging indent under the text after "->"
    # an unquoted broker command moves to the next line whole
    lines = wrap_plain("next: configure vast (VAST_API_KEY; see .env.example), then broker run RECIPE.yaml "
                       "--provider vast", 60)
    assert lines == ["next: configure vast (VAST_API_KEY; see .env.example), then",
                     "  broker run RECIPE.yaml --provider vast"]
    # a token longer than the width keeps a line of its own; a number keeps its unit; no lone last word
    long = "/very/" + "x" * 90 + "/path"
    assert wrap_plain(f"log: {long} written", 40) == ["log:", f"  {long}", "  written"]
    assert wrap_plain("worst case $0.39 at a 1.00 h deadline (snapshot)", 24) == [
        "worst case $0.39 at a", "  1.00 h deadline", "  (snapshot)"]
    assert wrap_plain("short line", 80) == ["short line"]


def test_console_prose_wraps_and_node_lines_stay_verbatim(monkeypatch):
    from broker.core.ui import _Console, echo_line
    import broker.core.ui as ui

    c = _Console(width=40, highlight=False, soft_wrap=True, emoji=False, force_terminal=False)
    monkeypatch.setattr(ui, "console", c)
    with c.capture() as cap:
        c.print("[bold]chosen:[/] simulated on vast: 2x RTX 3090 (Quebec, CA, NA), worst case $0.39")
        echo_line("[node 0] " + "a very long log line " * 4)
        echo_line("[preflight] tcp  0->1  FAIL  node 1 cannot reach node 0 at 198.18.0.1:29500")
    lines = cap.get().splitlines()
    assert lines[0] == "chosen: simulated on vast: 2x RTX 3090" and lines[1] == "  (Quebec, CA, NA), worst case $0.39"
    assert lines[2] == "[node 0] " + "a very long log line " * 4
    pre = lines[3:]  # broker's own line: wrapped under its tag
    assert len(pre) >= 2 and all(cell_len(ln) <= 40 for ln in pre), pre
    assert pre[0].startswith("[preflight] tcp  0->1  FAIL") and all(ln.startswith(" " * 14) for ln in pre[1:])
    assert pre[-1].strip().endswith(" 198.18.0.1:29500")  # no lone last piece


def test_broker_no_wrap_keeps_prose_on_one_line(cli_env):
    """BROKER_NO_WRAP=1 (logs meant for grep): prose lines are not wrapped; tables still fit the width."""
    out = _out(["plan", "--budget", "5"], dict(cli_env, BROKER_NO_WRAP="1"))
    chosen = [ln for ln in out.splitlines() if ln.startswith("chosen: ")]
    assert len(chosen) == 1 and cell_len(chosen[0]) > 80 and chosen[0].endswith("(SkyPilot catalog medians))")
    assert all(cell_len(ln) <= 80 for ln in _table_lines(out))


# ------------------------------------------------------------------------------------------------ whole cells
#: a money cell cut short ("$0.0") or whole ("$0.34", "$0.0050", "$1,234.00")
_MONEY = re.compile(r"\$\d[\d,]*\.?\d*")


def _cells_whole(out: str) -> None:
    """Every money value has its cents (2 or 4 decimals), "unlimited" is whole, no '…' and no header split."""
    assert "…" not in out, out
    for m in _MONEY.findall(out):
        assert re.fullmatch(r"\$[\d,]+\.\d{2}(\d{2})?", m), (m, out)
    assert not re.search(r"unlimite(?!d)", out), out


def _cpu_recipe(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "it.yaml"
    p.write_text("name: it\nscript: train.py\nnodes: 2\ngpus_per_node: 0\ncpu_ok: true\nbudget_usd: 5\n")
    return p


def test_plan_tables_at_80_columns_never_cut_a_value(cli_env, tmp_path):
    """At 80 columns `$/h` read "$0.0", `max h` "unlimite", an empty `mem` column took room and a CPU shape was
    cut to "VM.Standard.E2.1.Mic…"; with --wide the header `where` became "wh/er/e" and "us-east-1" split."""
    recipe = _cpu_recipe(tmp_path)
    default = _out(["plan", "--budget", "5"], cli_env)
    _cells_whole(default)
    header = next(ln for ln in default.splitlines() if "provider" in ln and "topology" in ln)
    assert re.search(r"\$/h\s+worst\s+max h", header), header
    cpu = _out(["plan", "--recipe", str(recipe)], cli_env)
    _cells_whole(cpu)
    header = next(ln for ln in cpu.splitlines() if "provider" in ln and "topology" in ln)
    assert " mem " not in header + " " and re.search(r"\$/h\s+worst\s+max h", header), header
    assert "VM.Standard.E2.1.Micro" in cpu, cpu
    wide = _out(["plan", "--recipe", str(recipe), "--wide"], cli_env)
    _cells_whole(wide)
    header = next(ln for ln in wide.splitlines() if "provider" in ln and "topology" in ln)
    assert re.search(r"\bwhere\s*$", header) and re.search(r"\$/h\s+worst\s+max h\s+prices", header), header
    assert "us-east-1" in wide, wide


def test_status_wide_at_80_columns_is_wider_rather_than_squeezed(cli_env, broker_home):
    """`broker status --wide` split its headers ("star/ted", "wors/t") and cut values ("stag", "$0.0")."""
    from datetime import timedelta

    from broker.money.ledger import Ledger
    from broker.core.model import utcnow
    from broker.providers.fake import FakeProvider
    from tests.support.watchdog_helpers import make_run, provision

    led = Ledger(broker_home / "ledger.sqlite")
    env = dict(cli_env, BROKER_FAKE_STATE=str(broker_home / "fake-cloud.json"))
    import os

    os.environ["BROKER_FAKE_STATE"] = env["BROKER_FAKE_STATE"]
    try:
        for status in ("provisioning", "succeeded", "tearing_down"):
            run = make_run(led, deadline=utcnow() + timedelta(hours=1), budget_usd=5.0, status=status)
        provision(led, FakeProvider(), run, nodes=1, usd_per_hour=0.0123)
    finally:
        os.environ.pop("BROKER_FAKE_STATE", None)
        led.close()
    out = _out(["status", "--wide", "--no-refresh"], env)
    _cells_whole(out)
    header = next(ln for ln in out.splitlines() if "status" in ln and "run" in ln)
    for h in ("started (UTC)", "spent / budget", "worst case", "time left", "exit codes"):
        assert h in header, header
    for s in ("provisioning", "succeeded", "tearing_down"):
        assert re.search(rf"\b{s}\b", out), out


@pytest.mark.parametrize("text, width, whole", [
    ("job: 2 node(s) x 1 GPU (>= 16 GiB, H900), 1 h deadline, budget none, topology any", 80, "topology any"),
    ("no offer has GPU model H900; models in the price snapshots: A10, A100 PCIE, A100 SXM4, H100 SXM, L4, "
     "RTX 3090, RTX 4090, T4, V100", 40, None),
])
def test_no_lone_last_word_and_model_names_stay_whole(text, width, whole):
    from rich.text import Text

    from broker.core.ui import wrap_text, wrap_words

    lines = wrap_text(Text(text), width).plain.split("\n")
    assert len(lines[-1].split()) >= 2, lines
    if whole:
        assert whole in lines[-1], lines
    for name in ("A100 PCIE", "RTX 3090", "H100 SXM", "A100 SXM4", "RTX 4090"):
        if name in text:
            assert any(name in ln for ln in lines), lines
            assert any(name in ln for ln in wrap_words(text, width)), wrap_words(text, width)


def test_run_help_keeps_backticked_commands_whole(cli_env):
    out = _out(["run", "--help"], cli_env)
    for span in re.findall(r"`[^`]+`", out.replace("\n", " ")):
        assert span in " ".join(out.split()) and "\n" not in span
    for ln in out.splitlines():
        assert ln.count("`") % 2 == 0, ln


def test_lint_prints_code_snippets_verbatim_on_their_own_lines(cli_env, tmp_path):
    t = tmp_path / "t.py"
    t.write_text("import os, torch\nrank = int(os.environ['RANK'])\ntorch.cuda.set_device(rank)\n")
    p = subprocess.run(broker_cmd("lint", str(t)), cwd=REPO, env=dict(cli_env, COLUMNS="80"), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [ln.strip() for ln in p.stdout.splitlines()]
    assert "local_rank = int(os.environ['LOCAL_RANK'])" in lines, p.stdout
    assert "torch.cuda.set_device(local_rank)" in lines, p.stdout


def _status_history(broker_home):
    """A ledger with a Slurm cluster run, a netns cluster torn down and an interrupted run (long names, topologies
    that repeat the provider's name, states with underscores)."""
    from datetime import timedelta

    from broker.money.ledger import Ledger, new_id
    from broker.core.model import utcnow
    from broker.core.records import Run

    led = Ledger(broker_home / "ledger.sqlite")
    now = utcnow()
    for name, prov, topo, st in [("sbatch-train_ddp_batchshell", "slurm", "slurm-cluster", "succeeded"),
                                 ("netns-cluster", "netns", "multi-node", "torn_down"),
                                 ("ddp_2node", "vast", "simulated", "interrupted"),
                                 ("ddp_2node", "local", "local", "tearing_down")]:
        led.create_run(Run(id=new_id("run-"), name=name, provider=prov, topology=topo, status=st, created_at=now,
                           started_at=now, deadline=now + timedelta(hours=1), budget_usd=5.0))
    led.close()


@pytest.mark.parametrize("columns", [80, 120])
def test_status_runs_fit_the_width_one_line_per_run(cli_env, broker_home, columns):
    """`broker status` with a Slurm run and an interrupted run was 82 columns in a pipe, split names
    ("sbatch-tra/in_ddp_bat/chshell"), cut "slurm-clust", put "$0.00 /" and "$5.00" on two rows and showed
    `torn_down`; names still split at 120 columns."""
    _status_history(broker_home)
    out = _out(["status", "--no-refresh"], cli_env, columns=columns)
    lines = out.split("runs\n", 1)[1].split("\nwatchdog:", 1)[0].splitlines()
    assert all(cell_len(ln) <= columns for ln in lines), [ln for ln in lines if cell_len(ln) > columns]
    body = [ln for ln in lines[2:] if ln.strip()]
    assert len(body) == 4 and all(ln.startswith("run-") for ln in body), out  # one line per run
    assert len(re.findall(r"\$0\.00 ?/ ?\$5\.00", out)) == 4, out  # money cells whole
    assert "torn down" in out and "tearing down" in out and "torn_down" not in out, out
    assert re.search(r"\bslurm\b", out) and "slurm-clust" not in out.replace("slurm-cluster", ""), out
    if columns == 120:
        assert "sbatch-train_ddp_batchshell" in out, out
    else:
        assert "sbatch-" in out and "…" in out, out
