"""Static check of training scripts and Slurm batch scripts for the mistakes that only bite on separate hosts.

Python scripts (``Finding.kind``):

* ``device-from-rank`` -- the GPU is chosen from the *global* rank: ``.cuda(rank)``, ``.to(rank)``,
  ``torch.cuda.set_device(rank)``, ``torch.device("cuda", rank)``, ``f"cuda:{rank}"``, ``"cuda:{}".format(rank)``,
  ``device_ids=[rank]``.  On node 1 of two single-GPU nodes RANK is 1 but the only GPU is ``cuda:0``.
* ``nccl-no-fallback`` -- ``init_process_group`` whose backend can be ``"nccl"`` (a literal, a variable,
  ``dist.Backend.NCCL``) when that choice is not guarded by a CUDA check.  A ``torch.cuda.is_available()`` /
  ``device_count()`` check counts only when it guards the choice: the ``if``/conditional expression that picks
  ``nccl`` (directly or through a flag such as ``use_cuda = torch.cuda.is_available()``), or a refusal before
  the call (``if not torch.cuda.is_available(): sys.exit(..)``, ``assert torch.cuda.is_available()``), which
  documents a GPU-only script; so does a ``# broker-lint: ignore[nccl-no-fallback]`` comment.  A test on the
  user's device switch (``"nccl" if args.device == "cuda" else "gloo"``) is a fallback too.  A check elsewhere
  (``if torch.cuda.device_count() > 1: model = ...``, a refusal in another function) does not count.
* ``local-rank-writes`` -- one-writer work keyed on LOCAL_RANK 0 (writes: ``torch.save``,
  ``export_chrome_trace``, ``to_csv``, ``json.dump(obj, f)``, ``open(.., "w")``, ``savefig``, ...; prints of
  results; calls of a helper of this file that does such work).  LOCAL_RANK 0 exists on every node, so every
  node does it.  A guard that is also on the global rank (``local_rank == 0 and rank == 0``) is fine.  A
  download under LOCAL_RANK 0 is not a finding: once per node is the fix for the next rule.
* ``download-global-rank-0`` -- a download done only by global rank 0 (``if rank == 0: urlretrieve(..)``,
  ``datasets.X(.., download=True)``, also in the ``else`` of ``if rank != 0: time.sleep(..)``, behind an
  ``is_main = dist.get_rank() == 0`` flag or after ``if rank != 0: return``): unless the nodes share storage the
  other hosts never get the data.
* ``slurm-env-under-torchrun`` -- ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` read before (preferred
  over) ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the same function (a module-level read comes before every
  function): under ``srun .. torchrun`` they count Slurm tasks (one per node), not torchrun's workers.  A
  helper that reads only SLURM_* is a fallback; a recipe's script (always started by torchrun) is flagged for
  any such read.
* ``syntax-error`` -- the file is not valid Python.

Slurm batch scripts (``#SBATCH`` lines; ``.sbatch``/``.slurm``/``.sh``):

* ``sbatch-torchrun-not-srun`` -- ``torchrun`` started directly from the batch shell of a multi-node allocation
  (``--nodes>1``/``-N 2``): the batch shell runs on the first node only, so one node trains and the job waits
  for the others until its time limit.
* ``sbatch-no-node-rank`` -- ``torchrun`` with several nodes but neither ``--node_rank`` nor a rendezvous
  (``--rdzv_backend``/``--rdzv_endpoint``), or with ``--standalone``.

Value provenance.  Names are resolved with astroid's scope lookup (one name table per function: a name is
followed to the assignments that reach it in its own scope), then followed through assignments, tuple
unpacking, aliases of ``os.environ`` (``env = os.environ``, ``from os import environ``), ``int()``/``str()``,
boolean flags (``is_main = local_rank == 0``), early-return guards (``if local_rank != 0: return``) and function
parameters: a parameter's value is what every call site in the module passes (``work(model, local_rank)`` makes
``rank`` in ``def work(model, rank)`` a local rank; ``Model(..)`` feeds ``__init__``; ``mp.spawn(fn, ..)`` passes
a process index, a fine device but not a rank-0 test on several nodes), its default where no call site is in
the file; ``self.x`` carries what the class assigns to it; helpers' return values and ``is_main()``-style
predicates are followed; ``args.local_rank in [-1, 0]``, ``accelerator.is_local_main_process`` and HF's
``is_world_process_zero()`` are rank-0 tests.  A name nothing can be learnt about falls back to its spelling
(``rank``/``global_rank`` global, ``local_rank`` local).
``rank % torch.cuda.device_count()`` is accepted as a device index.

astroid's value *inference* is not used: env-derived values are unknown at lint time (``int(os.environ["RANK"])``
infers to "an int", after 2.5 s of loading builtins), and it infers parameters as Uninferable; its tree and
scope lookup are what this module builds on.  The tree is built without brain transforms and without following
the script's imports (astroid would parse torch: 21 s for a 19-line dataclass file, 0.1 s without).  astroid is
imported lazily (``broker --help`` stays fast).

A finding is silenced by a ``# broker-lint: ignore`` (or ``ignore[kind,...]``) comment on its line.  Findings
are warnings for ``broker run``; a recipe's ``strict_lint: true`` turns them into a refusal.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from broker.lint.kinds import Finding, SBATCH_SUFFIXES, SKIP_DIRS
from broker.lint.script import lint_source
from broker.lint.sbatch import is_sbatch

if TYPE_CHECKING:
    from broker.core.recipe import Recipe


# ====================================================================================================== entry points
def lint_script(path: str | Path, *, launched_by_torchrun: bool = False) -> list[Finding]:
    """Findings for the file at ``path`` (sorted by line): a Slurm batch script when it has ``#SBATCH``
    directives (unless it is a ``.py`` file or has a python shebang), a broker recipe when it is ``.yaml``/``.yml``
    (:func:`lint_recipe_file`), Python otherwise.  Raises OSError when it cannot be read."""
    p = Path(path)
    from broker.lint.recipes import is_yaml_path

    if is_yaml_path(p):  # a recipe: its fields, then the script it names (never parsed as Python)
        return lint_recipe_file(p)
    text = p.read_text(encoding="utf-8", errors="replace")
    python = p.suffix == ".py" or re.match(r"#!.*python", text) is not None  # sbatch also runs Python scripts
    if not python and (is_sbatch(text) or p.suffix in SBATCH_SUFFIXES or re.match(r"#!.*\bsh\b|#!.*bash", text)):
        from broker.lint.shell import lint_shell  # torchrun/srun lines of any shell script

        return lint_shell(text, str(p))
    return lint_source(text, str(p), launched_by_torchrun=launched_by_torchrun)


def lintable_files(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """The files to lint under ``paths`` (a directory: its ``*.py``, its batch scripts and its broker recipes,
    recursively, hidden and virtual-env folders skipped; other YAML files there are left alone) and the problems
    (a path that does not exist, a YAML file given by name that is not a recipe, a directory with nothing to
    lint)."""
    from broker.lint.recipes import RECIPE_ADVICE, is_yaml_path, not_a_recipe

    files: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = []
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(p).parts
                if any(part in SKIP_DIRS or (part.startswith(".") and part not in (".", "..")) for part in rel[:-1]):
                    continue
                if not f.is_file():
                    continue
                if f.suffix == ".py":
                    found.append(f)
                elif f.suffix in SBATCH_SUFFIXES and (_head_is_sbatch(f) or _shell_launches(f)):
                    found.append(f)
                elif is_yaml_path(f) and _is_recipe(f):
                    found.append(f)
            if not found:
                problems.append(f"{p}: no Python script, Slurm batch script or broker recipe in this directory")
            files += found
        elif p.is_file() and is_yaml_path(p):
            try:
                what = not_a_recipe(p)
            except OSError as e:
                what = f"cannot be read ({e.strerror or e})"
            if what is None:
                files.append(p)
            else:
                problems.append(f"{p}: not a broker recipe ({what}); {RECIPE_ADVICE}")
        elif p.is_file() and p.suffix.lower() not in ("", ".py", ".pyw", *SBATCH_SUFFIXES) and not _has_shebang(p):
            # pyproject.toml, a notebook, a log: parsing it as Python would only report a syntax error
            problems.append(f"{p}: not a Python script, Slurm batch script or broker recipe (a {p.suffix} file); "
                            f"{RECIPE_ADVICE}")
        elif p.is_file():
            files.append(p)  # a shell script without #SBATCH: its torchrun/srun lines (broker.lint.shell)
        else:
            problems.append(f"{p}: no such file or directory")
    return files, problems


def _has_shebang(p: Path) -> bool:
    try:
        with p.open("rb") as fh:
            return fh.read(2) == b"#!"
    except OSError:
        return False


def _is_recipe(p: Path) -> bool:
    from broker.lint.recipes import not_a_recipe

    try:
        return not_a_recipe(p) is None
    except OSError:
        return False


def _shell_launches(p: Path) -> bool:
    from broker.lint.shell import launches  # a shell script that starts torchrun/srun (checked by broker.lint.shell)

    return launches(p)


def _head_is_sbatch(p: Path) -> bool:
    try:
        with p.open(encoding="utf-8", errors="replace") as fh:
            return is_sbatch(fh.read(65536))
    except OSError:
        return False


def lint_recipe(recipe: "Recipe") -> tuple[list[Finding], bool]:
    """Lint a recipe's script for ``broker run``: (findings, refuse).  ``refuse`` is True when the recipe asks
    for ``strict_lint`` and there is any finding, or the script does not parse; otherwise findings are warnings
    to print before launch.  The script runs under torchrun, so SLURM_* rank variables are findings."""
    findings = _cached_lint(Path(recipe.script))
    if recipe.cpu_only:  # a GPU asked for without a check fails on every rank of a CPU-only run

        try:
            findings = findings + cpu_run_findings(Path(recipe.script).read_text(), str(recipe.script))
        except OSError:
            pass
    syntax = any(f.kind == "syntax-error" for f in findings)  # would fail on every rank: never launch it
    return findings, syntax or (bool(findings) and recipe.strict_lint)


def lint_recipe_file(path: str | Path) -> list[Finding]:
    """Findings for the recipe at ``path``: one ``recipe-field`` finding when a field is wrong (the message and
    fix ``broker run`` would refuse it with), else the findings of its script (paths are the script's).
    Raises OSError when the recipe cannot be read."""
    from broker.core.recipe import RecipeError, load_recipe

    p = Path(path)
    try:
        recipe = load_recipe(p, resolve=False)  # ${NAME} env values need not be set to lint
    except RecipeError as e:
        m = re.match(rf"{re.escape(str(p))}:(\d+)(?::\d+)?:\s*", e.message)
        line = int(m.group(1)) if m else 1
        message = e.message[m.end():] if m else re.sub(rf"^{re.escape(str(p))}:?\s*", "", e.message)
        return [Finding(str(p), line, "recipe-field", message,
                        e.hint or "see recipes/ddp_2node.yaml for a complete recipe")]
    findings, _ = lint_recipe(recipe)
    return findings


#: bumped whenever a rule changes, so cached results of an older linter are not reused
LINT_CACHE_VERSION = 2


def _cached_lint(script: Path) -> list[Finding]:
    """:func:`lint_script` for a recipe's script (launched by torchrun), cached by the script's content in
    ``<broker home>/cache/lint.json``: the analysis costs about a second per process (astroid), and `broker run`
    lints the same unchanged script on every run.  The cache is best effort: any problem means a fresh lint."""
    import hashlib
    import json

    try:
        data = script.read_bytes()
    except OSError:
        return lint_script(script, launched_by_torchrun=True)
    key = f"{LINT_CACHE_VERSION}:{hashlib.sha256(data).hexdigest()}:{script.resolve()}"
    cache_file = None
    cache: dict = {}
    try:
        from broker.core.config import broker_home

        cache_file = broker_home() / "cache" / "lint.json"
        cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
        hit = cache.get(key)
        if isinstance(hit, list):
            return [Finding(**f) for f in hit]
    except Exception:  # noqa: BLE001 - an unreadable cache is a miss
        cache = {}
    findings = lint_script(script, launched_by_torchrun=True)
    if cache_file is not None:
        try:
            from dataclasses import asdict

            cache = {k: v for k, v in list(cache.items())[-200:]}  # bounded
            cache[key] = [asdict(f) for f in findings]
            from broker.core.private import private_dir, write_private

            private_dir(cache_file.parent)  # 0700 and 0600 from creation, as every file in the home
            tmp = cache_file.with_suffix(".tmp")
            write_private(tmp, json.dumps(cache))
            tmp.replace(cache_file)
        except Exception:  # noqa: BLE001 - a cache that cannot be written only costs time
            pass
    return findings


def cpu_run_findings(source: str, path: str) -> list[Any]:
    """``cuda-without-check`` findings of a script whose run is planned for CPU only (``gpus_per_node: 0``):
    a GPU asked for with no ``torch.cuda.is_available()`` (or ``device_count()``) check around it."""
    from broker.lint import script as lint
    from broker.lint.ddp import CPU_FIXES, _cuda_uses, _under_check

    try:
        module = lint._parse(source, path)
    except Exception:  # noqa: BLE001 - a script that does not parse gets its syntax-error finding elsewhere
        return []
    L = lint._Linter(module, path)
    out = []
    for c, what in _cuda_uses(L):
        if not _under_check(L, c):
            out.append(lint.Finding(path, c.lineno or 0, "cuda-without-check",
                                    f"{what} asks for a GPU with no torch.cuda.is_available() check, and this run "
                                    "is CPU-only (gloo): it fails on every rank",
                                    CPU_FIXES["cuda-without-check"]))
    return lint._suppressed(sorted(out, key=lambda f: f.line), source)
