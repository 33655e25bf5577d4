"""Recipe schema and loader.

A recipe is a YAML file describing one distributed training job::

    name: ddp-2node
    script: ddp_train.py          # run unchanged by torchrun; relative to the recipe file
    args: ["--epochs", "12"]
    workdir: .                    # copied to every node (default: the script's folder)
    env: {DDP_TIMEOUT_S: "120"}
    setup: ["python -c 'import torch'"]   # shell, once per node, before launch
    nodes: 2
    gpus_per_node: 1
    gpu: {models: [A10, L4, RTX 4090], min_mem_gib: 16}
    topology: any                 # simulated | multi-node | any | hybrid
    cpu_ok: true                  # gloo on CPU is an acceptable logic check
    budget_usd: 5
    max_hours: 0.5                # hard deadline (wall clock, hours)
    expect: ["DDP_OK", "accuracy=0\\.9"]   # regexes that must appear in the rank-0 log

Errors name the file, the line, the field and what is allowed (:class:`RecipeError`, exit code 2).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from broker.model import Requirements
from broker.provider import BadInput


class RecipeError(BadInput):
    """A recipe is wrong; the message names file, line, field and the fix."""


class GpuSpec(BaseModel):
    """Accepted GPU models (empty = any) and the minimum memory per GPU in GiB."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list)
    min_mem_gib: float = Field(default=16.0, ge=0)


class Recipe(BaseModel):
    """A validated recipe.  Paths are resolved against the recipe file's folder by :func:`load_recipe`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    script: Path
    args: list[str] = Field(default_factory=list)
    workdir: Path | None = None
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)
    nodes: int = Field(default=2, ge=1, le=64)
    gpus_per_node: int = Field(default=1, ge=1, le=16)
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    topology: Literal["simulated", "multi-node", "hybrid", "any"] = "any"
    cpu_ok: bool = False
    budget_usd: float = Field(default=5.0, gt=0)
    max_hours: float = Field(default=1.0, gt=0, le=168)
    expect: list[str] = Field(default_factory=list)
    artifacts: list[str] = Field(default_factory=list)  # globs collected from every node into <run>/artifacts/node<i>/
    disk_gib: float = Field(default=40.0, gt=0)
    image: str | None = None  # container image for Vast.ai (default: a PyTorch image)
    idle_minutes: float | None = Field(default=None, gt=0)
    # seconds to keep retrying SSH connect + auth after a node reports RUNNING (default per provider: OCI/AWS 300,
    # Vast.ai 180, others 120); counted in the plan's setup allowance
    ready_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    strict_lint: bool = False

    # set by the loader
    path: Path | None = Field(default=None, exclude=True)

    @field_validator("args", mode="before")
    @classmethod
    def _args_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in v]
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
                    raise ValueError(f"env name {k!r} is not a valid environment variable name")
                out[str(k)] = str(x).lower() if isinstance(x, bool) else (str(x) if x is not None else "")
            return out
        return v

    @field_validator("expect")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for i, pat in enumerate(v):
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"expect[{i}] {pat!r} is not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _workdir_default(self) -> "Recipe":
        if self.workdir is None:
            self.workdir = self.script.parent
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def requirements(self) -> Requirements:
        """The provider-independent job description the planner works on."""
        return Requirements(nodes=self.nodes, gpus_per_node=self.gpus_per_node, gpu_names=list(self.gpu.models),
                            min_gpu_mem_gib=self.gpu.min_mem_gib, hours=self.max_hours, budget_usd=self.budget_usd,
                            topology=self.topology, cpu_ok=self.cpu_ok, disk_gib=self.disk_gib)


_ALLOWED_HINT = {
    "topology": "one of: simulated, multi-node, any, hybrid",
    "name": "letters, digits, '-', '_' or '.', starting with a letter or digit (at most 63 characters)",
    "nodes": "a whole number from 1 to 64",
    "gpus_per_node": "a whole number from 1 to 16",
    "budget_usd": "a positive number of US dollars, e.g. 5",
    "max_hours": "a positive number of hours up to 168, e.g. 0.5",
    "cpu_ok": "true or false",
    "args": "a list of strings, e.g. [\"--epochs\", \"12\"]",
    "setup": "a list of shell commands (strings)",
    "env": "a mapping of NAME: value",
    "expect": "a list of regular expressions",
    "gpu": "a mapping with 'models' (list of GPU names) and 'min_mem_gib' (number)",
    "script": "the path of a Python training script, relative to the recipe",
}


def _line_map(node: Any, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map field paths (tuples of keys/indices) to 1-based line numbers from a yaml node tree."""
    import yaml

    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[path + (key,)] = k.start_mark.line + 1
            _line_map(v, path + (key,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[path + (i,)] = v.start_mark.line + 1
            _line_map(v, path + (i,), out)
    return out


def _fields_of(model: type[BaseModel]) -> list[str]:
    return [n for n in model.model_fields if n != "path"]


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file; resolve ``script`` and ``workdir`` relative to it.

    Raises RecipeError naming the file, line, field and what is allowed.
    """
    import yaml

    p = Path(path)
    if not p.exists():
        raise RecipeError(f"{p}: no such recipe file", hint="give the path of a .yaml recipe, e.g. recipes/ddp_2node.yaml")
    text = p.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{p}{where}: not valid YAML: {getattr(e, 'problem', e)}",
                          hint="check indentation and quoting on that line") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe must be a YAML mapping of fields (name, script, nodes, ...)",
                          hint="see recipes/ddp_2node.yaml for a complete example")
    lines = _line_map(node) if node is not None else {}

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(p, e, lines)) from None

    base = p.resolve().parent
    script = recipe.script if recipe.script.is_absolute() else base / recipe.script
    workdir = recipe.workdir if recipe.workdir.is_absolute() else base / recipe.workdir
    line = lines.get(("script",), "?")
    if "workdir" not in data:
        workdir = script.parent
        if not script.resolve().parent.is_relative_to(base):
            # the default workdir (the script's folder) would be a folder above the recipe: everything in it,
            # secrets included, would be copied to every node
            raise RecipeError(f"{p}:{line}: field 'script': {recipe.script} is outside the recipe's folder {base}, "
                              f"so its folder {script.resolve().parent} would be copied to every node",
                              hint="move the script next to the recipe, or set 'workdir:' explicitly to the folder "
                                   "to copy (only what it holds is staged; .gitignore/.brokerignore apply)")
    if not script.is_file():
        raise RecipeError(f"{p}:{line}: field 'script': {recipe.script} does not exist (looked for {script})",
                          hint="give the training script's path relative to the recipe file")
    if script.suffix != ".py":
        raise RecipeError(f"{p}:{line}: field 'script': {recipe.script} is not a Python file",
                          hint="torchrun runs a .py script; point 'script' at it")
    if not workdir.is_dir():
        raise RecipeError(f"{p}:{lines.get(('workdir',), '?')}: field 'workdir': {workdir} is not a folder",
                          hint="give a folder relative to the recipe file (it is copied to every node)")
    try:
        script.relative_to(workdir)
    except ValueError:
        raise RecipeError(f"{p}:{line}: field 'script': {script} is outside workdir {workdir}",
                          hint="the script must live inside 'workdir', which is what is copied to each node") from None
    return recipe.model_copy(update={"script": script, "workdir": workdir, "path": p.resolve()})


def _format_errors(p: Path, e: ValidationError, lines: dict[tuple, int]) -> str:
    msgs = []
    for err in e.errors():
        loc = tuple(err["loc"])
        field = ".".join(str(x) for x in loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:1]) or "?"
        if err["type"] == "extra_forbidden":
            model = GpuSpec if loc[:1] == ("gpu",) and len(loc) > 1 else Recipe
            known = _fields_of(model)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed fields: {', '.join(known)}"
            msgs.append(f"{p}:{line}: unknown field '{field}': {hint}")
            continue
        allowed = _ALLOWED_HINT.get(str(loc[0])) if loc else None
        msg = err["msg"]
        if err["type"] == "missing":
            msgs.append(f"{p}: missing required field '{field}'" + (f": {allowed}" if allowed else ""))
            continue
        got = err.get("input")
        got_s = f" (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else ""
        msgs.append(f"{p}:{line}: field '{field}': {msg}{got_s}" + (f"; allowed: {allowed}" if allowed else ""))
    return "\n".join(msgs)
