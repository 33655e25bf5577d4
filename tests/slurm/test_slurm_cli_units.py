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
