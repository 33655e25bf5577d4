"""``broker run SCRIPT.py``: the recipe a bare training script stands for.

A learner's first wish is to run the book's own script on two nodes without writing YAML first.  The script's
folder is the work folder (copied to every node, ``.gitignore`` / ``.brokerignore`` applied, credentials left
out), every field not given on the command line keeps the recipe default, and the equivalent recipe is printed so
that the next step (``--save FILE``) is a recipe like any other.  The recipe is then loaded by the same
:func:`broker.core.recipe.load_recipe` as a file, so every check, plan, confirmation and diagnosis is the same.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from broker.core.errors import BadInput

#: what marks a file as a script to run rather than a recipe to read
SCRIPT_SUFFIXES = (".py",)


def is_script(path: Path) -> bool:
    """True when ``path`` names a Python script (``broker run train.py``) rather than a recipe."""
    return path.suffix in SCRIPT_SUFFIXES


def _name(script: Path) -> str:
    """A recipe name (``^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$``) from the script's file name."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", script.stem).strip("-._")[:63]
    return name if name and name[0].isalnum() else f"job-{name}"[:63].rstrip("-") or "job"


def recipe_data(script: Path, *, args: list[str], nodes: int | None = None, gpus_per_node: int | None = None,
                gpu: list[str] | None = None, budget_usd: float | None = None, max_hours: float | None = None,
                cpu_ok: bool = False, setup: list[str] | None = None) -> dict[str, Any]:
    """The recipe fields for running ``script`` (fields not given keep the recipe defaults and are left out).
    ``script`` is named relative to its own folder, the recipe's place."""
    data: dict[str, Any] = {"name": _name(script), "script": script.name}
    if args:
        data["args"] = list(args)
    for key, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("budget_usd", budget_usd),
                       ("max_hours", max_hours)):
        if value is not None:
            data[key] = value
    if gpu:
        data["gpu"] = {"models": list(gpu)}
    if cpu_ok:
        data["cpu_ok"] = True
    if setup:
        data["setup"] = list(setup)
    return data


def recipe_text(data: dict[str, Any]) -> str:
    """``data`` as recipe YAML (field order kept, one field a line; a list of words on one line)."""
    import yaml

    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)
    for key in ("args", "setup"):  # block lists of one word a line read badly in a recipe: as ddp_2node.yaml writes
        if key in data:
            flow = yaml.safe_dump({key: data[key]}, default_flow_style=None, width=1000, allow_unicode=True)
            block = yaml.safe_dump({key: data[key]}, default_flow_style=False, width=1000, allow_unicode=True)
            body = body.replace(block, flow)
    return "# what `broker run` ran; edit it and `broker run` this file\n" + body


def placed(data: dict[str, Any], script: Path, folder: Path) -> dict[str, Any]:
    """``data`` for a recipe file in ``folder``: ``script`` (and ``workdir``, the script's folder, when it is not
    ``folder``) relative to it when the script is under it, else absolute."""
    out = dict(data)
    script = script.resolve()
    folder = folder.resolve()
    try:
        out["script"] = str(script.relative_to(folder))
    except ValueError:
        out["script"] = str(script)
    if script.parent != folder:
        try:
            work = str(script.parent.relative_to(folder))
        except ValueError:
            work = str(script.parent)
        keys = list(out)
        at = keys.index("script") + 1
        out = {**{k: out[k] for k in keys[:at]}, "workdir": work, **{k: out[k] for k in keys[at:]}}
    return out


def load_script(script: Path, data: dict[str, Any]) -> Any:
    """The :class:`~broker.core.recipe.Recipe` for ``data`` placed in ``script``'s folder (no file is written;
    ``path`` is None: there is no recipe file to name in hints).  Raises BadInput when ``script`` is not a file,
    RecipeError as for a recipe file."""
    from broker.core.recipe import load_recipe

    if not script.is_file():
        raise BadInput(f"{script}: no such script", hint="give the path of the training script, e.g. train.py, "
                       "or of a recipe (.yaml)")
    where = script.resolve().parent / f"{script.name} (broker run)"
    recipe = load_recipe(where, text=recipe_text(data)).model_copy(update={"path": None})
    recipe._from_script = True  # hints name the flags, not fields of a file the user has not got
    return recipe


def requirements_note(script: Path, setup: list[str] | None) -> str | None:
    """A line offering the script folder's ``requirements.txt`` to the nodes when ``--setup`` does not install it;
    None when there is none or it is installed already."""
    req = script.resolve().parent / "requirements.txt"
    if not req.is_file() or any("requirements.txt" in s for s in setup or []):
        return None
    return ("note: requirements.txt is next to the script; to install it on every node add "
            "--setup 'pip install -r requirements.txt'")


def save(path: Path, data: dict[str, Any], script: Path) -> Path:
    """Write the recipe of ``data`` to ``path`` (a new file), ``script:`` relative to ``path``'s folder
    (:func:`placed`).  Raises BadInput when the folder does not exist, the file exists or cannot be written, or
    the script is not under the file's folder (its folder, the work folder, would be above the recipe)."""
    import os
    import shlex

    base = path.resolve().parent
    if not base.is_dir():
        raise BadInput(f"--save {path}: the folder {base} does not exist", hint="make it first, or save the recipe "
                       f"next to the script: --save {shlex.quote(str(script.parent / (script.stem + '.yaml')))}")
    if not script.resolve().is_relative_to(base):
        raise BadInput(f"--save {path}: the script {script} is not under {base}, and a recipe's work folder is "
                       "the script's folder next to it", hint=f"save it next to the script, e.g. --save "
                       f"{shlex.quote(str(script.parent / (script.stem + '.yaml')))}")
    data = placed(data, script, base)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise BadInput(f"--save {path}: the file exists", hint="give a new file name, or remove it first") from None
    except OSError as e:
        raise BadInput(f"--save {path}: cannot write it ({e.strerror})", hint="check the folder and its "
                       "permissions") from None
    with os.fdopen(fd, "w") as f:
        f.write(recipe_text(data))
    return path
