"""Static check of a training script (Python ``ast``) for the classic mistakes that only bite on separate hosts.

Four kinds of finding (``Finding.kind``):

* ``device-from-rank`` -- the GPU is chosen from the *global* rank: ``.cuda(rank)``, ``.to(rank)``,
  ``torch.cuda.set_device(rank)``, ``torch.device("cuda", rank)``, ``f"cuda:{rank}"``, ``device_ids=[rank]``.
  On node 1 of two single-GPU nodes RANK is 1 but the only GPU is ``cuda:0`` ("invalid device ordinal").
* ``nccl-no-fallback`` -- ``init_process_group(backend="nccl")`` with no ``torch.cuda.is_available()`` condition:
  on a CPU-only node (or a CPU logic check) it fails instead of using gloo.
* ``local-rank-writes`` -- rank-0-only work keyed on LOCAL_RANK (``if local_rank == 0: torch.save(...)`` or
  ``open(..., "w")``): local rank 0 exists on *every* node, so every node writes the file.
* ``download-global-rank-0`` -- a download done only by global rank 0 (``if rank == 0: urlretrieve(...)`` or
  ``datasets.X(..., download=True)``): the other hosts never get the data (they have their own disks).

Provenance is tracked simply, per file: a name is a *global rank* when assigned from ``os.environ["RANK"]``,
``os.environ.get("RANK")``, ``os.getenv("RANK")``, any call with the literal ``"RANK"``/``"SLURM_PROCID"``
(``int(...)`` around it is fine) or ``dist.get_rank()``, or when it is literally named ``rank``/``global_rank``;
a *local rank* likewise from ``"LOCAL_RANK"``/``"SLURM_LOCALID"`` or the name ``local_rank``.  ``rank %
torch.cuda.device_count()`` is accepted as a device index.

Findings are warnings; ``broker lint --strict`` (or a recipe's ``strict_lint: true``) turns them into a refusal.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.recipe import Recipe

RANK_ENV = {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}
LOCAL_ENV = {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}
RANK_NAMES = {"rank", "global_rank", "world_rank"}
LOCAL_NAMES = {"local_rank", "localrank", "lrank"}
DOWNLOAD_CALLS = {"download", "urlretrieve", "urlopen", "hf_hub_download", "snapshot_download", "download_url",
                  "download_and_extract_archive", "download_file_from_google_drive", "load_dataset", "wget"}
WRITE_CALLS = {"save", "save_pretrained", "save_model", "savez", "to_csv", "to_parquet", "to_json", "dump",
               "write_text", "write_bytes", "save_checkpoint", "savefig", "save_state_dict"}

FIXES = {
    "device-from-rank": "pick the GPU from the local rank: local_rank = int(os.environ['LOCAL_RANK']); "
                        "torch.cuda.set_device(local_rank); device = torch.device('cuda', local_rank)",
    "nccl-no-fallback": "backend = 'nccl' if torch.cuda.is_available() else 'gloo'; "
                        "dist.init_process_group(backend=backend)",
    "local-rank-writes": "key one-writer work on the global rank: if int(os.environ['RANK']) == 0 "
                         "(or dist.get_rank() == 0)",
    "download-global-rank-0": "download once per node: if local_rank == 0: download(...), then dist.barrier() "
                              "before every rank reads it (or download on every rank)",
}


@dataclass(frozen=True)
class Finding:
    """One mistake: ``path:line``, its kind, what is wrong and the fix."""

    path: str
    line: int
    kind: str
    message: str
    fix: str

    def format(self) -> str:
        return f"{self.path}:{self.line}: [{self.kind}] {self.message}\n    fix: {self.fix}"


def _name(node: ast.AST) -> str | None:
    """Last component of a called name: ``torch.cuda.set_device`` -> ``set_device``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


class _Linter:
    def __init__(self, tree: ast.Module, path: str):
        self.tree = tree
        self.path = path
        self.names: dict[str, str] = {}  # variable -> "rank" | "local"
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ provenance
    def kind(self, e: ast.AST | None) -> str | None:
        """"rank" (global), "local" or None for an expression."""
        if e is None:
            return None
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return "rank" if e.value in RANK_ENV else "local" if e.value in LOCAL_ENV else None
        if isinstance(e, ast.Name):
            if e.id in self.names:
                return self.names[e.id]
            return "rank" if e.id in RANK_NAMES else "local" if e.id in LOCAL_NAMES else None
        if isinstance(e, ast.Attribute):  # args.rank / args.local_rank
            return "rank" if e.attr in RANK_NAMES else "local" if e.attr in LOCAL_NAMES else None
        if isinstance(e, ast.Subscript):  # os.environ["RANK"] (not shards[rank])
            return self.kind(e.slice) if _dotted(e.value).endswith("environ") else None
        if isinstance(e, ast.Call):
            fn = _name(e.func)
            if fn == "get_rank":
                return "rank"
            if fn in ("get_local_rank", "get_node_local_rank"):
                return "local"
            for a in e.args:  # os.environ.get("RANK", "0"), os.getenv("LOCAL_RANK"), env("RANK", ...)
                if isinstance(a, ast.Constant):
                    k = self.kind(a)
                    if k:
                        return k
            if fn in ("int", "str", "float") and e.args:
                return self.kind(e.args[0])
            return None
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, ast.Mod):  # rank % torch.cuda.device_count() is a valid device index
                return None
            return self.kind(e.left) or self.kind(e.right)
        if isinstance(e, ast.IfExp):
            return self.kind(e.body) or self.kind(e.orelse)
        if isinstance(e, ast.FormattedValue):
            return self.kind(e.value)
        return None

    def collect_names(self) -> None:
        assigns = [n for n in ast.walk(self.tree) if isinstance(n, (ast.Assign, ast.AnnAssign))]
        for _ in range(4):  # a few rounds: a = int(os.environ["RANK"]); b = a
            changed = False
            for a in assigns:
                targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                k = self.kind(a.value)
                for t in targets:
                    if isinstance(t, ast.Name) and k and self.names.get(t.id) != k:
                        self.names[t.id] = k
                        changed = True
            if not changed:
                break

    # ------------------------------------------------------------------ helpers
    def add(self, node: ast.AST, kind: str, message: str) -> None:
        line = getattr(node, "lineno", 0)
        if (line, kind) in self._seen:
            return
        self._seen.add((line, kind))
        self.findings.append(Finding(self.path, line, kind, message, FIXES[kind]))

    def _is_cuda_string_with_rank(self, e: ast.AST) -> bool:
        if isinstance(e, ast.JoinedStr):
            text = "".join(v.value for v in e.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            return "cuda" in text and any(isinstance(v, ast.FormattedValue) and self.kind(v) == "rank"
                                          for v in e.values)
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Mod)):  # "cuda:" + str(rank), "cuda:%d" % rank
            left = e.left
            if isinstance(left, ast.Constant) and isinstance(left.value, str) and "cuda" in left.value:
                return self.kind(e.right) == "rank"
        if isinstance(e, ast.Call) and _name(e.func) == "format" and isinstance(e.func, ast.Attribute):
            v = e.func.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str) and "cuda" in v.value:
                return any(self.kind(a) == "rank" for a in e.args)
        return False

    def _guarded_by_cuda_check(self, node: ast.AST) -> bool:
        p = self.parents.get(node)
        while p is not None:
            if isinstance(p, (ast.If, ast.IfExp, ast.While)) and _mentions_cuda_check(p.test):
                return True
            p = self.parents.get(p)
        # an explicit refusal elsewhere: if not torch.cuda.is_available(): raise/sys.exit(...)
        for n in ast.walk(self.tree):
            if isinstance(n, ast.If) and _mentions_cuda_check(n.test):
                for b in ast.walk(ast.Module(body=n.body, type_ignores=[])):
                    if isinstance(b, ast.Raise) or (isinstance(b, ast.Call) and _name(b.func) in ("exit", "_exit")):
                        return True
        return False

    def _rank_zero_test(self, test: ast.AST) -> str | None:
        """'rank' / 'local' when ``test`` means "this is (global/local) rank 0"."""
        if isinstance(test, ast.BoolOp):
            for v in test.values:
                k = self._rank_zero_test(v)
                if k:
                    return k
            return None
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return self.kind(test.operand)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is)):
            left, right = test.left, test.comparators[0]
            for a, b in ((left, right), (right, left)):
                if isinstance(b, ast.Constant) and b.value in (0, "0"):
                    return self.kind(a)
        return None

    # ------------------------------------------------------------------ rules
    def check(self) -> list[Finding]:
        self.collect_names()
        for n in ast.walk(self.tree):
            if isinstance(n, ast.Call):
                self._call(n)
            elif isinstance(n, ast.If):
                self._if(n)
            elif isinstance(n, (ast.JoinedStr, ast.BinOp)) and self._is_cuda_string_with_rank(n):
                self.add(n, "device-from-rank", f"device string {ast.unparse(n)} is built from the global rank")
        self.findings.sort(key=lambda f: (f.line, f.kind))
        return self.findings

    def _call(self, c: ast.Call) -> None:
        fn = _name(c.func)
        arg0 = c.args[0] if c.args else None
        if fn in ("cuda", "to", "set_device") and isinstance(c.func, ast.Attribute) and self.kind(arg0) == "rank":
            self.add(c, "device-from-rank", f"{ast.unparse(c.func)}({ast.unparse(arg0)}) picks the GPU from the "
                     "global rank; on a second node RANK >= the number of GPUs there")
        if fn == "device" and len(c.args) >= 2 and isinstance(c.args[0], ast.Constant) and \
                c.args[0].value == "cuda" and self.kind(c.args[1]) == "rank":
            self.add(c, "device-from-rank", f"{ast.unparse(c)} picks the GPU from the global rank")
        for kw in c.keywords:
            if kw.arg == "device_ids" and isinstance(kw.value, (ast.List, ast.Tuple)) and \
                    any(self.kind(x) == "rank" for x in kw.value.elts):
                self.add(c, "device-from-rank", f"device_ids={ast.unparse(kw.value)} uses the global rank")
            if kw.arg == "device" and self.kind(kw.value) == "rank":
                self.add(c, "device-from-rank", f"device={ast.unparse(kw.value)} is the global rank")
        if fn == "init_process_group":
            backend = arg0 if arg0 is not None else next((k.value for k in c.keywords if k.arg == "backend"), None)
            if isinstance(backend, ast.Constant) and isinstance(backend.value, str) and \
                    backend.value.strip().lower() == "nccl" and not self._guarded_by_cuda_check(c):
                self.add(c, "nccl-no-fallback", "init_process_group(backend=\"nccl\") with no CUDA check: fails on "
                         "a node without a usable GPU instead of falling back to gloo")

    def _if(self, node: ast.If) -> None:
        who = self._rank_zero_test(node.test)
        if who is None:
            return
        body = ast.Module(body=node.body, type_ignores=[])
        for n in ast.walk(body):
            if not isinstance(n, ast.Call):
                continue
            fn = _name(n.func)
            if who == "local" and (fn in WRITE_CALLS or (fn == "open" and _write_mode(n))):
                self.add(n, "local-rank-writes", f"`{ast.unparse(n)[:60]}` runs under `if {ast.unparse(node.test)}`"
                         ": LOCAL_RANK 0 exists on every node, so every node writes it")
                return
            if who == "rank" and (fn in DOWNLOAD_CALLS or any(
                    k.arg == "download" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in n.keywords)):
                self.add(n, "download-global-rank-0", f"`{ast.unparse(n)[:60]}` runs only under "
                         f"`if {ast.unparse(node.test)}`: global rank 0 is on one host, the other hosts get no data")
                return


def _mentions_cuda_check(test: ast.AST) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.Attribute) and n.attr in ("is_available", "device_count"):
            return True
    return False


def _write_mode(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(ch in mode.value for ch in "wax+")


def lint_source(source: str, path: str = "<script>") -> list[Finding]:
    """Findings for Python ``source`` (``path`` is used in the messages).  A syntax error is one finding of kind
    ``syntax-error``."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        FIXES.setdefault("syntax-error", "fix the syntax error; torchrun would fail on every rank")
        return [Finding(path, e.lineno or 0, "syntax-error", f"not valid Python: {e.msg}", FIXES["syntax-error"])]
    return _Linter(tree, path).check()


def lint_script(path: str | Path) -> list[Finding]:
    """Findings for the script at ``path`` (sorted by line).  Raises OSError when it cannot be read."""
    p = Path(path)
    return lint_source(p.read_text(encoding="utf-8", errors="replace"), str(p))


def lint_recipe(recipe: "Recipe") -> tuple[list[Finding], bool]:
    """Lint a recipe's script for ``broker run``: (findings, refuse).  ``refuse`` is True when the recipe asks
    for ``strict_lint`` and there is any finding; otherwise findings are warnings to print before launch."""
    findings = lint_script(recipe.script)
    syntax = any(f.kind == "syntax-error" for f in findings)  # would fail on every rank: never launch it
    return findings, syntax or (bool(findings) and recipe.strict_lint)
