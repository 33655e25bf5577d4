"""CLI edges of `broker slurm submit` and `broker exec CLUSTER -- CMD` that need no cluster."""

from __future__ import annotations

from typer.testing import CliRunner

from broker.core.provider import BadInput


def test_exec_refuses_arguments_after_the_recipe_on_an_ordinary_run():
    from broker.cli.app import app

    r = CliRunner().invoke(app, ["exec", "no-such-run", "recipes/ddp_2node.yaml", "extra"])
    assert isinstance(r.exception, BadInput) and "unexpected argument" in str(r.exception)


def test_submit_to_an_unknown_cluster_is_bad_input(tmp_path):
    from broker.cli.app import app

    job = tmp_path / "job.sh"
    job.write_text("#!/bin/bash\n#SBATCH --nodes=1\necho hi\n")
    r = CliRunner().invoke(app, ["slurm", "submit", str(job), "--cluster", "nope"])
    assert isinstance(r.exception, BadInput) and "no Slurm cluster 'nope'" in str(r.exception)


def test_slurm_up_help_names_every_provider_it_accepts():
    """The --provider help is the adapters' ``slurm_nodes`` declarations, not a list kept by hand."""
    import re

    from broker.cli.app import app
    from broker.providers import SLURM_NODES

    r = CliRunner().invoke(app, ["slurm", "up", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    text = " ".join(re.sub(r"[│╭╰─╮╯]", " ", r.output).split())
    assert "gcp" in SLURM_NODES
    for name in SLURM_NODES:
        assert re.search(rf"\b{name}\b", text.split("--provider", 1)[1].split("--nodes", 1)[0]), (name, text)
