"""A local run given ``idle_minutes`` (recipe or ``--idle-minutes``) says that it keeps nothing: the flag was
silently ignored, and a learner waited for nodes to `broker ssh` into that were gone."""

from __future__ import annotations

from types import SimpleNamespace

from broker.core.recipe import Recipe
from broker.run.targets import LocalTarget


def _said(recipe: Recipe) -> list[str]:
    lines: list[str] = []
    LocalTarget(recipe).prepare(SimpleNamespace(say=lines.append))
    return lines


def test_idle_minutes_on_a_local_run_is_named_as_ignored(tmp_path):
    (tmp_path / "t.py").write_text("print('x')\n")
    base = dict(name="t", script=tmp_path / "t.py", workdir=tmp_path, nodes=2, cpu_ok=True, gpus_per_node=0)
    assert _said(Recipe.model_validate(base)) == []
    said = _said(Recipe.model_validate(dict(base, idle_minutes=5)))
    assert len(said) == 1 and said[0].startswith("note: recipe idle_minutes=5 is ignored: ")
    assert "processes on this machine" in said[0]
    flag = Recipe.model_validate(base).with_idle_minutes(3)
    assert _said(flag)[0].startswith("note: --idle-minutes 3 is ignored: ")
