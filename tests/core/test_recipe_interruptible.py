"""Recipe fields for interruptible capacity: interruptible (true/false/auto), checkpoint_dir (inside the workdir),
checkpoint_every_s (> 0) and max_restarts (>= 0); bad values are refused with the field and the fix."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from broker.core.recipe import RecipeError, load_recipe

BASE = "name: job-1\nscript: train.py\n"


def write(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "r.yaml"
    p.write_text(BASE + textwrap.dedent(extra))
    return p


def test_defaults_are_on_demand_with_sixty_second_copies_and_three_restarts(tmp_path):
    r = load_recipe(write(tmp_path, ""))
    assert r.interruptible == "false"
    assert r.checkpoint_dir is None and r.checkpoint_every_s == 60 and r.max_restarts == 3
    assert not r.warnings


@pytest.mark.parametrize("written,read", [("true", "true"), ("false", "false"), ("auto", "auto"),
                                          ('"auto"', "auto"), ("Auto", "auto"), ('"true"', "true"),
                                          ("yes", "true"), ("no", "false")])
def test_interruptible_takes_yaml_booleans_and_auto(tmp_path, written, read):
    r = load_recipe(write(tmp_path, f"interruptible: {written}\ncheckpoint_dir: ck\n"))
    assert r.interruptible == read
    # the serialized recipe (recipe.json, the ledger's run row) reads back as the same recipe
    assert json.loads(r.model_dump_json())["interruptible"] == read


@pytest.mark.parametrize("bad", ["sometimes", "1", "[true]", "spot"])
def test_interruptible_other_values_are_refused_naming_the_field(tmp_path, bad):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, f"interruptible: {bad}\n"))
    msg = str(e.value)
    assert "'interruptible'" in msg and "r.yaml:3" in msg and "true, false or auto" in msg


def test_checkpoint_fields_good(tmp_path):
    r = load_recipe(write(tmp_path, "interruptible: true\ncheckpoint_dir: out/ckpt/\ncheckpoint_every_s: 30\n"
                                    "max_restarts: 0\n"))
    assert r.checkpoint_dir == "out/ckpt" and r.checkpoint_every_s == 30 and r.max_restarts == 0
    assert not r.warnings


@pytest.mark.parametrize("bad,words", [
    ("/tmp/ck", "absolute"), ("../ck", "leaves the workdir"), ("a/../../ck", "leaves the workdir"),
    ("~/ck", "absolute"), (".", "the workdir itself"), ("./", "the workdir itself"), ('""', "empty"),
    ('"a\\\\b"', "backslash"), ('"a\\nb"', "control character"), ("3", "text"),
])
def test_checkpoint_dir_outside_the_workdir_is_refused(tmp_path, bad, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, f"checkpoint_dir: {bad}\n"))
    msg = str(e.value)
    assert "checkpoint_dir" in msg and words in msg and "r.yaml:3" in msg, msg


def test_checkpoint_dir_through_a_symlink_out_of_the_workdir_is_refused(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, work / "ck")
    (work / "train.py").write_text("print('hi')\n")
    p = work / "r.yaml"
    p.write_text(BASE + "checkpoint_dir: ck\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "outside workdir" in str(e.value) and "checkpoint_dir" in str(e.value)


def test_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    p = write(tmp_path, "checkpoint_dir: train.py\n")
    with pytest.raises(RecipeError, match="is a file in the workdir"):
        load_recipe(p)


def test_checkpoint_dir_is_relative_to_the_workdir_not_the_recipe(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    p = tmp_path / "r.yaml"
    p.write_text("name: j\nscript: code/train.py\nworkdir: code\ncheckpoint_dir: ck\n")
    r = load_recipe(p)
    assert r.workdir / r.checkpoint_dir == (tmp_path / "code" / "ck")


@pytest.mark.parametrize("field,bad,words", [
    ("checkpoint_every_s", "0", "more than 0"), ("checkpoint_every_s", "-5", "more than 0"),
    ("checkpoint_every_s", "2.5", "whole number"), ("checkpoint_every_s", '"60"', "whole number"),
    ("checkpoint_every_s", "true", "whole number"), ("checkpoint_every_s", "100000", "largest allowed"),
    ("max_restarts", "-1", "at least 0"), ("max_restarts", "1.5", "whole number"),
    ("max_restarts", "1000", "largest allowed"),
])
def test_numbers_are_bounded_and_whole(tmp_path, field, bad, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, f"{field}: {bad}\n"))
    msg = str(e.value)
    assert f"'{field}'" in msg and words in msg and "allowed" in msg, msg


def test_interruptible_without_checkpoint_dir_warns_that_it_restarts_from_scratch(tmp_path):
    r = load_recipe(write(tmp_path, "interruptible: true\n"))
    assert len(r.warnings) == 1 and "checkpoint_dir" in r.warnings[0] and "from the beginning" in r.warnings[0]
    auto = load_recipe(write(tmp_path, "interruptible: auto\n"))  # warned once the plan chooses interruptible
    assert not auto.warnings and "from the beginning" in (auto.chosen_interruptible_warning() or "")


def test_misspelt_field_is_suggested(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'checkpoint_dir'"):
        load_recipe(write(tmp_path, "checkpoint_dirs: ck\n"))


def test_requirements_carry_the_interruptible_fields_to_the_planner(tmp_path):
    r = load_recipe(write(tmp_path, "interruptible: auto\ncheckpoint_dir: ck\ncheckpoint_every_s: 30\n"
                                    "max_restarts: 5\n"))
    req = r.requirements()
    assert (req.interruptible, req.max_restarts, req.checkpoint_every_s) == ("auto", 5, 30)
    d = load_recipe(write(tmp_path, "")).requirements()
    assert (d.interruptible, d.max_restarts, d.checkpoint_every_s) == ("false", 3, 60)


@pytest.mark.parametrize("bad, near", [("bogus", None), ("atuo", "auto"), ("ture", "true")])
def test_a_bad_interruptible_value_reads_once_and_gives_the_fix_the_flag_gives(tmp_path, bad, near):
    """The choice error said "is not one of the allowed values allowed: ..." and had no `->` fix line, while
    `--interruptible` had one: both now give the same sentence and the same fix, in their own spelling."""
    from broker.core.errors import BadInput
    from broker.core.recipe import check_interruptible

    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, f"interruptible: {bad}\n"))
    assert "allowed values allowed" not in e.value.message, e.value.message
    assert f"r.yaml:3: field 'interruptible': '{bad}' is not one of the allowed values: true, false or auto" in \
        e.value.message
    assert e.value.hint and "e.g. interruptible: auto" in e.value.hint and "interruptible: false" in e.value.hint
    with pytest.raises(BadInput) as f:
        check_interruptible("--interruptible", bad)
    assert f.value.message.removeprefix("--interruptible") == \
        e.value.message.split("r.yaml:3: field 'interruptible':", 1)[1]
    assert f.value.hint == e.value.hint.replace("interruptible:", "--interruptible")
    if near:
        assert f"did you mean interruptible: {near}?" in e.value.hint


@pytest.mark.parametrize("word, read", [("yes", "true"), ("on", "true"), ("no", "false"), ("Off", "false"),
                                        ("TRUE", "true"), (" auto ", "auto")])
def test_the_flag_takes_every_word_the_recipe_field_takes(tmp_path, word, read):
    """`interruptible: yes` (a YAML boolean) was read as true, but `--interruptible yes` was refused."""
    from broker.core.recipe import check_interruptible

    assert check_interruptible("--interruptible", word) == read
    assert load_recipe(write(tmp_path, f"interruptible: {word.strip()}\ncheckpoint_dir: ck\n")).interruptible == read
    assert load_recipe(write(tmp_path, f"interruptible: '{word}'\ncheckpoint_dir: ck\n")).interruptible == read


def test_other_choice_errors_read_once_and_name_the_fix(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, "topology: multinode\n"))
    assert e.value.message.endswith("field 'topology': 'multinode' is not one of the allowed values: simulated, "
                                    "multi-node, any or hybrid"), e.value.message
    assert e.value.hint == "did you mean 'multi-node'? write topology: multi-node"
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, "on_stall: pause\n"))
    assert "allowed values: stop or report" in e.value.message and e.value.hint == \
        "write on_stall: followed by one of: stop, report"


def test_the_flags_checkpoint_warning_names_the_recipe_as_typed(tmp_path, monkeypatch):
    """`--interruptible true` said "set checkpoint_dir: in /abs/path/r.yaml" for a recipe typed as r.yaml."""
    write(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    (warn,) = load_recipe("r.yaml").with_interruptible("true").warnings
    assert "set checkpoint_dir: in r.yaml to the folder" in warn, warn
