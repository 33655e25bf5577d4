"""``broker init [DIR]``: write the example recipes (and their training scripts and data) into a folder.

The examples ship inside the package as ``broker.recipes`` (the repository's ``recipes/`` folder, installed as
package data), so they are there after a plain ``pip install``.
"""

from __future__ import annotations

from pathlib import Path

import typer

#: what is copied: recipes, their scripts, their data (never caches)
_SUFFIXES = (".yaml", ".yml", ".py", ".md", ".gz", ".csv")


def example_files() -> dict[str, bytes]:
    """Relative path -> content of every shipped example file."""
    from importlib.resources import files

    root = files("broker.recipes")
    out: dict[str, bytes] = {}

    def walk(node, rel: str) -> None:
        for child in node.iterdir():
            name = child.name
            if name.startswith((".", "__")):  # __init__.py (it makes the folder a package), __pycache__
                continue
            if child.is_dir():
                walk(child, f"{rel}{name}/")
            elif name.endswith(_SUFFIXES):
                out[f"{rel}{name}"] = child.read_bytes()

    walk(root, "")
    return out


def init_cmd(
    directory: Path = typer.Argument(Path("broker-recipes"), metavar="[DIR]",
                                     help="folder to write the examples into (created; default ./broker-recipes)"),
    force: bool = typer.Option(False, "--force", help="overwrite files that already exist"),
) -> None:
    """Write the example recipes (a 2-node DDP training job, an all-reduce benchmark) into DIR."""
    from broker.core.errors import BadInput

    files = example_files()
    if not files:
        raise BadInput("this broker installation ships no example recipes",
                       hint="reinstall broker (pip install --force-reinstall broker)")
    if directory.exists() and not directory.is_dir():
        raise BadInput(f"{directory} exists and is not a folder", hint="give a new or empty folder")
    clash = sorted(r for r in files if (directory / r).exists())
    if clash and not force:
        raise BadInput(f"{directory} already holds {', '.join(clash[:4])}" + (" ..." if len(clash) > 4 else ""),
                       hint="give another folder, or pass --force to overwrite them")
    for rel, data in sorted(files.items()):
        p = directory / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    recipes = sorted(r for r in files if r.endswith((".yaml", ".yml")) and "/" not in r)
    from broker.core.ui import console

    console.print(f"wrote {len(files)} files to {directory}/ (recipes: {', '.join(recipes)})", markup=False)
    if recipes:
        first = "ddp_2node.yaml" if "ddp_2node.yaml" in recipes else recipes[0]
        import shlex

        where = shlex.quote(str(directory / first))  # `broker init "my dir"`: pasted, the hint must work
        plan, run = f"broker plan --recipe {where}", f"broker run {where}"
        console.print(f"next: {plan}   then: {run}", markup=False, keep=[plan, run])
