"""Recipe schema and loader.

A recipe is a YAML file describing one distributed training job::

    name: ddp-2node
    script: ddp_train.py          # run unchanged by torchrun; relative to the recipe file
    args: ["--epochs", "12"]
    workdir: .                    # copied to every node (default: the script's folder)
    env: {DDP_TIMEOUT_S: "120"}
    setup: ["python -c 'import torch'"]   # shell, once per node, before launch
    nodes: 2
    gpus_per_node: 1              # 0 = a CPU-only job (needs cpu_ok: true): one gloo process per node
    gpu: {models: [A10, L4, RTX 4090], min_mem_gib: 16}
    topology: any                 # simulated | multi-node | any | hybrid
    cpu_ok: true                  # gloo on CPU is an acceptable logic check
    budget_usd: 5
    max_hours: 0.5                # hard deadline (wall clock, hours)
    expect: ["DDP_OK", "accuracy=0\\.9"]   # regexes that must appear in the rank-0 log

Strict: numbers must be numbers (``nodes: true`` or ``nodes: "2"`` is an error), ``env`` values are scalars, a key
given twice is an error, and YAML aliases are bounded (:data:`broker.core.limits.MAX_YAML_ALIASES`, expanded size
:data:`broker.core.limits.MAX_YAML_NODES`).  Numeric bounds come from :mod:`broker.core.limits`, shared with the CLI flags.

``env`` values may reference variables of the environment or of ``.env`` (current directory) as ``${NAME}``:
:func:`load_recipe` resolves them into :attr:`Recipe.env` (what the nodes get), while the recipe's serialized
form (``model_dump``, the copy in the ledger's run row, ``--json``) keeps the ``${NAME}`` text, never the value.

``secrets:`` lists names only (``secrets: [WANDB_API_KEY, HF_TOKEN]``, like SkyPilot's ``secrets:``): each value
comes from the environment (first) or ``.env`` when the recipe is loaded to run, goes into the nodes' environment
(:attr:`Recipe.env`) and nowhere else: ``model_dump`` (``recipe.json``, the ledger, ``--json``) shows the names,
never a value.  An ``env:`` value whose name looks secret (``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``)
is masked the same way, with a warning (:attr:`Recipe.warnings`) that points to ``secrets:``.

Errors name the file, the line, the field and what is allowed (:class:`RecipeError`, exit code 2).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictStr, ValidationError,
                      field_serializer, field_validator, model_validator)

from broker.core import limits
from broker.core.errors import BadInput
from broker.core.model import Requirements
from broker.core.recipe_interruptible import (  # noqa: F401 - the interruptible words; importable from here
    INTERRUPTIBLE_ALLOWED, INTERRUPTIBLE_WORDS, _NO_CHECKPOINT_MARK, check_interruptible, interruptible_refusal,
    interruptible_warning, interruptible_word)
from broker.core.recipe_yaml import (  # noqa: F401 - reading the file; names kept importable from here
    RecipeError, MAX_RECIPE_BYTES, _YamlLimit, _strict_loader, _expanded_size, _NOT_YAML_TEXT, _caret, parse_yaml, _line_map, _fields_of, _folder_error, _read_text, _BOMS, _utf16_or_32)


#: a number in exponent notation as YAML 1.2 writes it (``1e12``, ``-2.5E-3``)
_EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _as_number(v: Any) -> Any:
    """``v`` as a number when it is exponent-notation text (YAML 1.1 leaves ``1e12`` text), else ``v``; whole
    values stay whole (``nodes: 1e1`` is 10)."""
    if isinstance(v, str) and _EXPONENT_NUMBER.fullmatch(v.strip()):
        f = float(v)
        return int(f) if f.is_integer() and abs(f) < 2**53 else f
    return v


def _bounded(field: str, default: Any) -> Any:
    """A strict numeric Field bounded by :data:`broker.core.limits.LIMITS` [field]."""
    lo, hi, open_lo, _, _ = limits.LIMITS[field]
    low = {"gt": lo} if open_lo else {"ge": lo}
    if field in limits.INTEGER_FIELDS:
        return Field(default=default, strict=True, le=hi, **low)
    return Field(default=default, strict=True, allow_inf_nan=False, le=hi, **low)


#: ``${NAME}`` in an env value: a variable of the environment or ``.env``
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class GpuSpec(BaseModel):
    """Accepted GPU models (empty = any) and the minimum memory per GPU in GiB."""

    model_config = ConfigDict(extra="forbid")

    models: list[StrictStr] = Field(default_factory=list)
    min_mem_gib: float = _bounded("min_mem_gib", 16.0)


class Recipe(BaseModel):
    """A validated recipe.  Paths are resolved against the recipe file's folder by :func:`load_recipe`."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    script: Path
    args: list[StrictStr] = Field(default_factory=list)
    workdir: Path | None = None
    env: dict[str, str] = Field(default_factory=dict)
    #: names of variables whose values the nodes get from this machine's environment or .env (never stored)
    secrets: list[StrictStr] = Field(default_factory=list)
    setup: list[StrictStr] = Field(default_factory=list)
    nodes: int = _bounded("nodes", 2)
    gpus_per_node: int = _bounded("gpus_per_node", 1)
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    topology: Literal["simulated", "multi-node", "hybrid", "any"] = "any"
    cpu_ok: StrictBool = False
    budget_usd: float = _bounded("budget_usd", 5.0)
    max_hours: float = _bounded("max_hours", 1.0)
    expect: list[StrictStr] = Field(default_factory=list)
    artifacts: list[StrictStr] = Field(default_factory=list)  # globs collected from every node into <run>/artifacts/node<i>/
    disk_gib: float = _bounded("disk_gib", 40.0)
    image: StrictStr | None = None  # container image for Vast.ai (default: a PyTorch image)
    idle_minutes: float | None = _bounded("idle_minutes", None)
    # seconds to keep retrying SSH connect + auth after a node reports RUNNING (default per provider: OCI 600, AWS 420,
    # Vast.ai 180, others 120)
    ready_timeout_s: float | None = Field(default=None, gt=0, le=3600)
    strict_lint: StrictBool = False
    # seconds without output from any node before broker samples the ranks' stacks to name a hang (broker.run.stall);
    # 0 turns the watch off; on_stall: stop every node (a paid hang burns money) or only report it
    stall_s: float = Field(default=60.0, ge=0, le=86400)
    on_stall: Literal["stop", "report"] = "stop"
    # interruptible (bid / spot / preemptible) capacity: "true" rents it, "auto" only when its expected cost with
    # restarts is lower than on-demand, "false" never (YAML true/false are accepted and read as "true"/"false")
    interruptible: Literal["false", "true", "auto"] = "false"
    #: folder (relative to the workdir, inside it) the job writes its checkpoints to: copied back from node 0
    #: every ``checkpoint_every_s`` seconds and restored on the new node(s) after a preemption; None = none
    checkpoint_dir: StrictStr | None = None
    #: seconds between copies of ``checkpoint_dir`` back from node 0 (> 0)
    checkpoint_every_s: int = Field(default=60, strict=True, gt=0, le=86400)
    #: how many times a preempted run is rented again and relaunched (0 = never; attempts = max_restarts + 1)
    max_restarts: int = Field(default=3, strict=True, ge=0, le=100)
    #: stage the ``checkpoint_dir`` found in the work folder into the first attempt (start from an earlier run's
    #: checkpoint); false (the default): it is left out, a new run starts without it
    resume_checkpoint: StrictBool = False

    # set by the loader
    path: Path | None = Field(default=None, exclude=True)
    #: env as written (``${NAME}`` references unresolved): what model_dump / the ledger / --json show
    _env_template: dict[str, str] = PrivateAttr(default_factory=dict)
    #: the ``secrets:`` values (resolved by the loader; merged into ``env`` for the nodes, never serialized)
    _secret_values: dict[str, str] = PrivateAttr(default_factory=dict)
    #: one-line warnings found while loading (secret-looking env names), for the CLI to print
    _load_warnings: list[str] = PrivateAttr(default_factory=list)
    #: field -> 1-based line in the recipe file (for errors raised after loading: :meth:`where`)
    _lines: dict[tuple, int] = PrivateAttr(default_factory=dict)
    #: the command-line flag that set ``interruptible`` (``--interruptible``), None = the file's value
    _interruptible_flag: str | None = PrivateAttr(default=None)
    #: the command-line flag that set ``idle_minutes`` (``--idle-minutes``), None = the file's value
    _idle_flag: str | None = PrivateAttr(default=None)
    #: built by ``broker run SCRIPT.py`` from flags (:mod:`broker.core.scriptrecipe`): hints name the flags
    _from_script: bool = PrivateAttr(default=False)

    @property
    def from_script(self) -> bool:
        """Whether this recipe stands for ``broker run SCRIPT.py`` and its flags (no recipe file to edit)."""
        return self._from_script

    def with_idle_minutes(self, value: float | None, flag: str = "--idle-minutes") -> "Recipe":
        """A copy with ``idle_minutes`` set by the command line's ``flag`` (None: this recipe unchanged)."""
        if value is None:
            return self
        out = self.model_copy(update={"idle_minutes": float(value)})
        out._idle_flag = flag
        return out

    def idle_words(self) -> str:
        """How the user set ``idle_minutes``, for a line about it: ``--idle-minutes 3`` or ``recipe
        idle_minutes=3``."""
        v = f"{self.idle_minutes:g}" if self.idle_minutes is not None else "none"
        return f"{self._idle_flag} {v}" if self._idle_flag else f"recipe idle_minutes={v}"

    def where(self, field: str) -> str:
        """``file:line: field 'name'`` (or ``--flag value`` when a command-line flag set it) for an error about
        ``field`` raised after loading."""
        if field == "interruptible" and self._interruptible_flag:
            return f"{self._interruptible_flag} {self.interruptible}"
        return f"{self.path or 'recipe'}:{self._lines.get((field,), '?')}: field '{field}'"

    def with_interruptible(self, value: str | None, flag: str = "--interruptible") -> "Recipe":
        """A copy with ``interruptible`` set by the command line's ``flag`` (None: this recipe unchanged), checked
        with the field's words (:func:`check_interruptible`); the "without checkpoint_dir" warning follows the new
        value.  Raises BadInput for a value that is not one of them."""
        v = check_interruptible(flag, value)
        if v is None:
            return self
        out = self.model_copy(update={"interruptible": v})
        out._interruptible_flag = flag
        out._load_warnings = [w for w in self._load_warnings if _NO_CHECKPOINT_MARK not in w]
        warn = None if v == "auto" else interruptible_warning(f"{flag} {v}", v, self.checkpoint_dir,
                                                              Path(shown_path(self.path)) if self.path else None)
        if warn:
            out._load_warnings.append(warn)
        return out

    def chosen_interruptible_warning(self) -> str | None:
        """The "without checkpoint_dir" warning of ``interruptible: auto``, for once the plan has chosen an
        interruptible option (auto may choose on-demand capacity or this machine, which are never preempted);
        None when the value is not auto or a ``checkpoint_dir`` is set."""
        if self.interruptible != "auto":
            return None
        if self._interruptible_flag:
            return interruptible_warning(f"{self._interruptible_flag} auto", "auto", self.checkpoint_dir, self.path)
        return interruptible_warning(f"{self.path or 'recipe'}:{self._lines.get(('interruptible',), '?')}: "
                                     "interruptible: auto", "auto", self.checkpoint_dir)

    def plan_flags(self) -> str:
        """The ``broker plan`` flags that reproduce what the command line changed in this recipe (``""`` or
        `` --interruptible auto``), for every hint that suggests a plan command."""
        return f" --interruptible {self.interruptible}" if self._interruptible_flag else ""

    @property
    def warnings(self) -> list[str]:
        """One-line warnings found while loading (an ``env:`` value whose name looks secret), for the CLI."""
        return list(self._load_warnings)

    @field_validator("script", "workdir", mode="before")
    @classmethod
    def _path_text(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, Path)):
            raise ValueError(f"expected a path (text), got {type(v).__name__}")
        return v

    #: ``gpus_per_node: 0`` was given (a CPU-only job): the planner sees 0 GPUs per node (free-tier CPU machines
    #: qualify), the launchers one process per node (``gpus_per_node`` is then 1)
    cpu_only: bool = Field(default=False, exclude=True)

    @model_validator(mode="after")
    def _cpu_only(self) -> "Recipe":
        self.cpu_only = self.gpus_per_node == 0  # never set from the file directly
        if self.cpu_only:
            if not self.cpu_ok:
                raise ValueError("gpus_per_node 0 (a CPU-only job) needs cpu_ok: true")
            self.gpus_per_node = 1
        return self

    @field_serializer("gpus_per_node")
    def _gpus_as_written(self, n: int) -> int:
        """What the recipe said: 0 for a CPU-only job (the launchers' 1 process per node is not the user's value;
        recipe.json / the ledger / --json read back as the same recipe)."""
        return 0 if self.cpu_only else n

    @field_validator("interruptible", mode="before")
    @classmethod
    def _interruptible_words(cls, v: Any) -> Any:
        """The words of :data:`INTERRUPTIBLE_WORDS` (the ``--interruptible`` flag takes the same): YAML booleans
        (``true``, ``yes``, ``off``) and text in any case (``Auto``); anything else is left for the choice check."""
        word = interruptible_word(v)
        return v if word is None else word

    @field_validator("checkpoint_dir")
    @classmethod
    def _checkpoint_relative(cls, v: str | None) -> str | None:
        """A folder inside the workdir, written relative to it: never absolute, never ``..``, never the workdir
        itself (restoring it would overwrite the job's code), no control characters or backslashes (it becomes
        a path on every node and in shell words)."""
        if v is None:
            return v
        from pathlib import PurePosixPath

        if not v.strip():
            raise ValueError("the folder name is empty")
        if any(ord(c) < 32 or ord(c) == 127 for c in v) or "\\" in v:
            raise ValueError(f"{v!r} holds a control character or a backslash; write a plain relative folder "
                             "such as checkpoints")
        pp = PurePosixPath(v)
        if pp.is_absolute() or v.startswith("~"):
            raise ValueError(f"{v!r} is an absolute path; give a folder relative to the workdir, e.g. checkpoints")
        if ".." in pp.parts:
            raise ValueError(f"{v!r} leaves the workdir ('..'); give a folder inside the workdir, e.g. checkpoints")
        norm = str(pp)
        if norm in (".", ""):
            raise ValueError("'.' is the workdir itself; give a sub-folder of it, e.g. checkpoints")
        return norm

    @field_validator("setup", "expect", "artifacts", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        """One text where a list is expected (``setup: "pip install -r requirements.txt"``, as SkyPilot takes it;
        a ``|`` block is one shell script) is a list of that one entry."""
        return [v] if isinstance(v, str) else v

    @model_validator(mode="before")
    @classmethod
    def _exponent_numbers(cls, data: Any) -> Any:
        """Numbers written with an exponent and no dot (``budget_usd: 1e12``) are numbers: YAML 1.1 (PyYAML) reads
        them as text, YAML 1.2 as numbers; they then meet the field's bounds like any number."""
        if isinstance(data, dict):
            data = {k: _as_number(v) if k in limits.LIMITS else v for k, v in data.items()}
            gpu = data.get("gpu")
            if isinstance(gpu, dict) and "min_mem_gib" in gpu:
                data["gpu"] = {**gpu, "min_mem_gib": _as_number(gpu["min_mem_gib"])}
        return data

    @field_validator("args", mode="before")
    @classmethod
    def _args_strings(cls, v: Any) -> Any:
        if isinstance(v, list):  # numbers are fine as arguments ("--epochs", 12); nothing else but text
            return [str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in v]
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                    raise ValueError(f"env name {k!r} is not a valid environment variable name")
                if isinstance(x, (dict, list)):
                    raise ValueError(f"env {k}: a value must be text, a number or true/false, not a "
                                     f"{'mapping' if isinstance(x, dict) else 'list'}")
                if x is not None and not isinstance(x, (str, int, float, bool)):
                    raise ValueError(f"env {k}: a value must be text, a number or true/false")
                out[k] = str(x).lower() if isinstance(x, bool) else (str(x) if x is not None else "")
            return out
        return v

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        seen: set[str] = set()
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"secret name {name!r} is not a valid environment variable name (a name, not a "
                                 "value: the value comes from the environment or .env)")
            if name in seen:
                raise ValueError(f"secret {name!r} is listed twice")
            seen.add(name)
        return v

    @model_validator(mode="after")
    def _secrets_not_in_env(self) -> "Recipe":
        both = sorted(set(self.secrets) & set(self.env))
        if both:
            raise ValueError(f"{', '.join(both)} is in both 'env' and 'secrets'; keep it in 'secrets' only (its "
                             "value then comes from the environment or .env and is never stored)")
        return self

    @field_serializer("env")
    def _env_as_written(self, env: dict[str, str]) -> dict[str, str]:
        """Never serialize a resolved ``${NAME}`` value (the template text stands in for it), a ``secrets:``
        value (left out: the ``secrets`` list names it), the literal value of a secret-looking name (masked) or the
        password of a URL with credentials (masked)."""
        from broker.core.private import MASK, looks_secret, mask_url_credentials

        t = self._env_template
        out = {}
        for k, v in env.items():
            if k in self.secrets:  # a secrets: value merged in by the loader (env itself never names one)
                continue
            written = t.get(k, v)
            if _ENV_REF.search(written):
                out[k] = mask_url_credentials(written)
            else:  # a URL's password is a secret whatever the name (scheme://user:password@host)
                out[k] = MASK if looks_secret(k) and written else mask_url_credentials(written)
        return out

    def env_references(self) -> list[str]:
        """Names of the variables the env values reference as ``${NAME}`` (sorted, unique)."""
        src = self._env_template or self.env
        return sorted({m for v in src.values() for m in _ENV_REF.findall(v)})

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
        return Requirements(nodes=self.nodes, gpus_per_node=0 if self.cpu_only else self.gpus_per_node,
                            gpu_names=list(self.gpu.models),
                            min_gpu_mem_gib=self.gpu.min_mem_gib, hours=self.max_hours, budget_usd=self.budget_usd,
                            topology=self.topology, cpu_ok=self.cpu_ok, disk_gib=self.disk_gib,
                            interruptible=self.interruptible, max_restarts=self.max_restarts,
                            checkpoint_every_s=self.checkpoint_every_s)


_ALLOWED_HINT = {
    "topology": "simulated, multi-node, any or hybrid",
    "name": "letters, digits, '-', '_' or '.', starting with a letter or digit (at most 63 characters)",
    "nodes": limits.allowed("nodes"),
    "gpus_per_node": limits.allowed("gpus_per_node") + " (0 = CPU-only, with cpu_ok: true)",
    "budget_usd": limits.allowed("budget_usd"),
    "max_hours": limits.allowed("max_hours"),
    "disk_gib": limits.allowed("disk_gib"),
    "idle_minutes": limits.allowed("idle_minutes"),
    "cpu_ok": "true or false",
    "strict_lint": "true or false",
    "stall_s": "seconds without output before the ranks' stacks are read (0 to 1 day; 0 = off)",
    "on_stall": "stop or report",
    "args": "a list of strings, e.g. [\"--epochs\", \"12\"]",
    "setup": "a shell command (text) or a list of shell commands",
    "env": "a mapping of NAME: value (text, number or true/false; ${OTHER} takes OTHER from the environment)",
    "secrets": "a list of variable names (their values come from the environment or .env), e.g. [WANDB_API_KEY]",
    "expect": "a list of regular expressions",
    "artifacts": "a list of file paths (strings)",
    "image": "a container image name (text)",
    "gpu": "a mapping with 'models' (list of GPU names) and 'min_mem_gib' (number)",
    "script": "the path of a Python training script, relative to the recipe",
    "workdir": "a folder relative to the recipe file",
    "interruptible": INTERRUPTIBLE_ALLOWED,
    "checkpoint_dir": "a folder inside the workdir, relative to it (e.g. checkpoints)",
    "checkpoint_every_s": "whole seconds between checkpoint copies, more than 0 (at most 86400)",
    "max_restarts": "a whole number of restarts after preemptions, 0 to 100",
    "resume_checkpoint": "true or false (true: the first attempt starts from the checkpoint_dir in the workdir)",
}
_ALLOWED_GPU = {"min_mem_gib": limits.allowed("min_mem_gib"), "models": "a list of GPU model names (strings)"}

#: largest recipe file read (bytes)
def _dotenv() -> dict[str, str]:
    """Variables of ``.env`` in the current directory (python-dotenv, as the settings read it); {} without one."""
    env_file = Path(".env")
    if not env_file.is_file():
        return {}
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(env_file).items() if v is not None}


def resolve_env(env: dict[str, str], *, where: str = "recipe",
                lines: dict[tuple, int] | None = None) -> dict[str, str]:
    """``env`` with every ``${NAME}`` replaced by NAME's value from the environment (first) or ``.env``.

    Raises RecipeError naming the variable (never a value) when one is not set.
    """
    if not any(_ENV_REF.search(v) for v in env.values()):
        return dict(env)
    import os

    dot = _dotenv()
    out = {}
    for k, v in env.items():
        def sub(m: re.Match) -> str:
            name = m.group(1)
            val = os.environ.get(name, dot.get(name))
            if val is None:
                line = (lines or {}).get(("env", k)) or (lines or {}).get(("env",)) or "?"
                raise RecipeError(f"{where}:{line}: field 'env.{k}': ${{{name}}} is not set in the environment "
                                  "or in .env",
                                  hint=f"export {name}=... (or add {name}=... to .env) before running")
            return val

        out[k] = _ENV_REF.sub(sub, v)
    return out


def load_recipe(path: str | Path, *, resolve: bool = True, text: str | None = None) -> Recipe:
    """Read and validate a recipe file; resolve ``script`` and ``workdir`` relative to it.

    ``resolve``: substitute ``${NAME}`` in env values (needed to run; ``broker plan`` reads a recipe without).
    ``text``: the recipe's YAML when it is not read from ``path`` (``broker run SCRIPT.py`` builds one; ``path``
    then only places it: paths in it are relative to ``path``'s folder).
    Raises RecipeError naming the file, line, field and what is allowed.
    """
    p = Path(path)
    if text is None:
        text = _read_text(p)
    node, data = parse_yaml(text, str(p))
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe must be a YAML mapping of fields (name, script, nodes, ...)",
                          hint="see recipes/ddp_2node.yaml for a complete example (`broker init` writes it)")
    lines = _line_map(node) if node is not None else {}

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        message, fix = _format_errors(p, e, lines)
        raise RecipeError(message, hint=fix) from None

    base = p.resolve().parent
    script = recipe.script if recipe.script.is_absolute() else base / recipe.script
    workdir = recipe.workdir if recipe.workdir.is_absolute() else base / recipe.workdir
    line = lines.get(("script",), "?")
    if script.is_dir():
        raise RecipeError(f"{p}:{line}: field 'script': {recipe.script} is a folder ({script.resolve()}); 'script' "
                          "must name the training script file",
                          hint="e.g. script: train.py (a .py file next to the recipe); the folder copied to every "
                               "node is 'workdir:' (default: the script's folder)")
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
    if recipe.resume_checkpoint and recipe.checkpoint_dir is None:
        raise RecipeError(f"{p}:{lines.get(('resume_checkpoint',), '?')}: field 'resume_checkpoint': true needs "
                          "'checkpoint_dir:' (the folder in the workdir to start from)",
                          hint="set checkpoint_dir: to the folder your script loads its checkpoint from (e.g. "
                               "checkpoints), or drop resume_checkpoint")
    if recipe.checkpoint_dir is not None:
        # a symlink inside the workdir may point out of it: the folder copied back and restored must be inside
        ck = (workdir / recipe.checkpoint_dir).resolve()
        if not ck.is_relative_to(workdir.resolve()) or ck == workdir.resolve():
            raise RecipeError(f"{p}:{lines.get(('checkpoint_dir',), '?')}: field 'checkpoint_dir': "
                              f"{recipe.checkpoint_dir} resolves to {ck}, outside workdir {workdir.resolve()} "
                              "(a symbolic link?)",
                              hint="give a plain folder inside the workdir (e.g. checkpoints), not a link out of it")
        if ck.exists() and not ck.is_dir():
            raise RecipeError(f"{p}:{lines.get(('checkpoint_dir',), '?')}: field 'checkpoint_dir': "
                              f"{recipe.checkpoint_dir} is a file in the workdir, not a folder",
                              hint="name the folder the job writes its checkpoints into (e.g. checkpoints)")
    _refuse_named_checkpoint_files(recipe, script, workdir, f"{p}:{lines.get(('checkpoint_dir',), '?')}")
    template = dict(recipe.env)
    _refuse_broker_credentials(template, p, lines)
    env = resolve_env(template, where=str(p), lines=lines) if resolve else template
    secret_values = resolve_secrets(recipe.secrets, where=str(p), lines=lines) if resolve else {}
    from broker.core.private import looks_secret, register_secret, url_passwords

    for k, v in env.items():
        if looks_secret(k):
            register_secret(v)  # a ${NAME} resolved into a secret-looking name: no log line shows its value
        for pw in url_passwords(v):  # scheme://user:password@host: the password is a secret whatever the name
            register_secret(pw)
    out = recipe.model_copy(update={"script": script, "workdir": workdir, "path": p.resolve(),
                                    "env": {**env, **secret_values}})
    out._env_template = template
    out._secret_values = secret_values
    out._load_warnings = _secret_env_warnings(template, p, lines)
    out._lines = lines
    # auto may well choose on-demand capacity (or this machine): its warning waits for the plan
    # (Recipe.chosen_interruptible_warning)
    warn = None if recipe.interruptible == "auto" else interruptible_warning(
        f"{p}:{lines.get(('interruptible',), '?')}: interruptible: {recipe.interruptible}", recipe.interruptible,
        recipe.checkpoint_dir)
    if warn:
        out._load_warnings.append(warn)
    return out


def shown_path(path: Path | str | None) -> str:
    """``path`` (a recipe file) for a hint the user copies: relative to the current folder when it is under it
    (``recipes/ddp_2node.yaml``, as typed), else as given; ``""`` for None."""
    if path is None:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def path_words(script: Path | str, args: list[str] = ()) -> list[str]:
    """The words of a recipe that may name a file: its script and each argument (the value of ``--opt=value``),
    flags (``-x``, ``--opt``) and empty words left out."""
    words = [str(script), *[a.split("=", 1)[1] if a.startswith("-") and "=" in a else a for a in args]]
    return [w for w in words if w and not w.startswith("-")]


def _refuse_named_checkpoint_files(recipe: Recipe, script: Path, workdir: Path, where: str) -> None:
    """Raise RecipeError when the script (``script``: its resolved path) or an argument (relative to ``workdir``)
    names a file inside ``checkpoint_dir`` and ``resume_checkpoint`` is false: that folder is not staged, so the
    job would not find the file on the node."""
    if recipe.checkpoint_dir is None or recipe.resume_checkpoint:
        return
    root = workdir.resolve()
    ck = (root / recipe.checkpoint_dir).resolve()
    for word in path_words(script, recipe.args):
        try:
            real = (Path(word) if Path(word).is_absolute() else root / word).resolve()
            named = real.is_file() and ck in real.parents
        except OSError:
            continue
        if named:
            said = "'script'" if word == str(script) else "'args'"
            raise RecipeError(f"{where}: field 'checkpoint_dir': {recipe.checkpoint_dir} holds "
                              f"{real.relative_to(root).as_posix()}, which {said} names; checkpoint_dir is not "
                              "staged (a new run starts without it), so the job would not find that file",
                              hint="name another folder as checkpoint_dir (one the job only writes checkpoints "
                                   "to, e.g. checkpoints), or set resume_checkpoint: true to stage it")


def resolve_secrets(names: list[str], *, where: str = "recipe",
                    lines: dict[tuple, int] | None = None) -> dict[str, str]:
    """The values of the recipe's ``secrets:`` names, from the environment (first) or ``.env`` in the current
    folder; an empty value counts as unset.  Each value is registered with :func:`broker.core.private.register_secret`
    so no log line shows it.  Raises RecipeError naming the file, line and variable (never a value) when one is
    not set, before anything is rented."""
    if not names:
        return {}
    import os

    from broker.core.private import register_secret

    dot = _dotenv()
    out: dict[str, str] = {}
    for i, name in enumerate(names):
        val = os.environ.get(name) or dot.get(name)
        if not val:
            line = (lines or {}).get(("secrets", i)) or (lines or {}).get(("secrets",)) or "?"
            raise RecipeError(f"{where}:{line}: field 'secrets': {name} is not set in the environment or in .env "
                              "(a secret's value is read from this machine when the run starts, never from the "
                              "recipe)", hint=f"export {name}=... (or add {name}=... to .env in the folder you run "
                                              "broker from) and run again")
        register_secret(val)
        out[name] = val
    return out


def _refuse_broker_credentials(env: dict[str, str], p: Path, lines: dict[tuple, int]) -> None:
    """Raise RecipeError when an ``env:`` value references one of broker's own credentials (``${VAST_API_KEY}``,
    ``${AWS_SECRET_ACCESS_KEY}``: :func:`broker.core.private.is_broker_secret`): a recipe, often written by someone
    else, would copy the user's cloud keys to every rented node.  ``secrets:`` is the explicit way."""
    from broker.core.private import is_broker_secret

    for k, v in env.items():
        for name in _ENV_REF.findall(v):
            if is_broker_secret(name):
                line = lines.get(("env", k)) or lines.get(("env",)) or "?"
                raise RecipeError(f"{p}:{line}: field 'env.{k}': ${{{name}}} is broker's own credential; an env: "
                                  "value would copy it to every node (and into recipe.json's template)",
                                  hint=f"remove it from env:, or, if the job really needs {name}, list it under "
                                       f"'secrets: [{name}]' (its value then goes only to the nodes' environment)")


def _secret_env_warnings(env: dict[str, str], p: Path, lines: dict[tuple, int]) -> list[str]:
    """One line per ``env:`` name that looks secret and holds a literal value (not a ``${NAME}`` reference), and
    per value that is a URL with a password (``scheme://user:password@host``)."""
    from broker.core.private import URL_CREDENTIALS, looks_secret

    out = []
    for k, v in env.items():
        if v and not looks_secret(k) and URL_CREDENTIALS.search(v) and not _ENV_REF.search(v):
            line = lines.get(("env", k)) or lines.get(("env",)) or "?"
            out.append(f"{p}:{line}: env {k} is a URL with a password: the password is masked in recipe.json, the "
                       f"ledger and --json, but it is written in the recipe; move it to 'secrets: [{k}]' and export "
                       f"{k} (or put it in .env)")
    for k, v in env.items():
        if looks_secret(k) and v and not _ENV_REF.search(v):
            line = lines.get(("env", k)) or lines.get(("env",)) or "?"
            out.append(f"{p}:{line}: env {k} looks like a secret: its value is masked in recipe.json, the ledger "
                       f"and --json, but it is written in the recipe; move it to 'secrets: [{k}]' and export {k} "
                       "(or put it in .env)")
    return out


def _pattern_sentence(value: str) -> str:
    """Why ``value`` is not a valid name, in words: the characters that are not allowed, a bad first character,
    or the length."""
    bad = sorted({c for c in value if not (c.isascii() and (c.isalnum() or c in "_.-"))})
    if bad:
        return (f"{', '.join(repr(c) for c in bad)} {'is' if len(bad) == 1 else 'are'} not allowed in a name "
                "(ASCII letters, digits, '-', '_' and '.' only)")
    if not value:
        return "the name is empty"
    if not value[0].isalnum():
        return f"a name must start with a letter or digit, not {value[0]!r}"
    if len(value) > 63:
        return f"the name is {len(value)} characters long; at most 63 are allowed"
    return "not a valid name"


#: pydantic error types -> what the value must be, as a user reads it
_TYPE_WORDS = {"int_parsing": "a whole number", "int_type": "a whole number", "int_from_float": "a whole number",
               "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
               "bool_type": "true or false", "string_type": "text", "list_type": "a list", "dict_type": "a mapping"}


def _type_sentence(field: str, err: dict, allowed: str | None) -> tuple[str, str | None] | None:
    """A validator's type or choice error as a sentence and, for a choice, its fix (the closest valid value:
    ``multinode``: did you mean 'multi-node'?).  None for other errors."""
    import re

    got = err.get("input")
    shown = limits.plain(got) if isinstance(got, float) else repr(got)
    if err["type"] in ("literal_error", "enum"):
        if field == "interruptible":  # the words and the fix the --interruptible flag gives
            return interruptible_refusal(f"field '{field}':", got, f"{field}:")
        from broker.core.choices import closest

        choices = re.findall(r"'([^']*)'", str((err.get("ctx") or {}).get("expected", "")))
        near = closest(str(got), choices) if choices and got is not None else None
        return (f"field '{field}': {shown} is not one of the allowed values: {allowed or ', '.join(choices)}",
                f"did you mean '{near}'? write {field}: {near}" if near else
                f"write {field}: followed by one of: {', '.join(choices)}")
    what = _TYPE_WORDS.get(err["type"])
    if what is None:
        return None
    return (f"field '{field}' must be {what}, not {shown}" + (f"; allowed: {allowed}" if allowed and allowed != what
                                                               else ""), None)


def _format_errors(p: Path, e: ValidationError, lines: dict[tuple, int]) -> tuple[str, str | None]:
    """The validation errors as lines naming the file, line and field, and the fix for those that have one (a
    choice: the closest value), joined by "; " (None when none has)."""
    msgs: list[str] = []
    fixes: list[str] = []
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
        allowed = (_ALLOWED_GPU.get(str(loc[1])) if loc[:1] == ("gpu",) and len(loc) > 1 else
                   _ALLOWED_HINT.get(str(loc[0]))) if loc else None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "string_pattern_mismatch" and isinstance(err.get("input"), str):
            msg = _pattern_sentence(err["input"])  # a sentence, never the regular expression
        bound = err.get("ctx") or {}
        said = False  # the message already shows the value
        if isinstance(err.get("input"), (int, float)) and not isinstance(err.get("input"), bool) and \
                err["type"] in ("less_than_equal", "less_than", "greater_than", "greater_than_equal"):
            v = limits.plain(err["input"])
            if "le" in bound or "lt" in bound:
                msg = f"{v} is more than the largest allowed, {limits.plain(bound.get('le', bound.get('lt')))}"
            else:
                msg = f"{v} is too small: it must be " + (f"more than {limits.plain(bound['gt'])}" if "gt" in bound
                                                         else f"at least {limits.plain(bound.get('ge'))}")
            said = True
        if err["type"] == "missing":
            msgs.append(f"{p}: missing required field '{field}'" + (f": {allowed}" if allowed else ""))
            continue
        sentence = _type_sentence(field, err, allowed)
        if sentence:
            msgs.append(f"{p}:{line}: {sentence[0]}")
            if sentence[1]:
                fixes.append(sentence[1])
            continue
        got = err.get("input")
        shown = limits.plain(got) if isinstance(got, float) else repr(got)  # 1e9 reads 1000000000, not 1e+09
        got_s = f" (got {shown})" if got is not None and not isinstance(got, (dict, list)) and not said else ""
        msgs.append(f"{p}:{line}: field '{field}': {msg}{got_s}" + (f"; allowed: {allowed}" if allowed else ""))
    return "\n".join(msgs), "; ".join(fixes) or None
