"""The Python-script rules (``device-from-rank``, ``nccl-no-fallback``, ``local-rank-writes``,
``download-global-rank-0``, ``slurm-env-under-torchrun``, ``syntax-error``; see :mod:`broker.lint.rules`):
:class:`_Linter` walks one module with astroid, :func:`lint_source` runs it and applies the ignore comments.
"""

from __future__ import annotations

import re
from typing import Any

from broker.lint.kinds import (DOWNLOAD_CALLS, DUMP_CALLS, FIXES, Finding, LOCAL_ENV, MAIN_PROCESS_NAMES, RANK_ENV,
                               SLURM_VS_TORCHRUN, SPAWN_CALLS, Test, WRITE_CALLS, _DEVICE_FORMAT, _DEVICE_PERCENT,
                               _DEVICE_PREFIX, _WORK_NAMES, _attr_or_name, _env_kind, _exits, _is_str, _memoized,
                               _spelling)


class _Linter:
    def __init__(self, module: Any, path: str, *, launched_by_torchrun: bool = False):
        from astroid import nodes

        self.n = nodes
        self.module = module
        self.path = path
        self.torchrun = launched_by_torchrun
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str]] = set()
        self.calls = list(module.nodes_of_class(nodes.Call))
        self._values_memo: dict[int, tuple[list, bool]] = {}
        self._busy: set[int] = set()
        self._work_memo: dict[int, list] = {}
        self._callee_memo: dict[int, Any] = {}
        self._sites: dict[int, list] | None = None  # built once by _call_index
        self._spawns: dict[str, list] = {}
        self._memo: dict[tuple[str, int], Any] = {}
        #: every name bound somewhere in the file; lookups of other names would load astroid's builtins (~1 s)
        self.bound: set[str] = {x.name for x in module.nodes_of_class((nodes.AssignName, nodes.FunctionDef,
                                                                        nodes.ClassDef))}
        for imp in module.nodes_of_class((nodes.Import, nodes.ImportFrom)):
            self.bound |= {(alias or name).split(".")[0] for name, alias in imp.names}

    # ------------------------------------------------------------------ name resolution (astroid lookup)
    def values(self, name_node: Any) -> tuple[list, bool]:
        """The expressions that may flow into ``name_node`` (a Name): assignment right-hand sides (tuple
        elements when unpacked), the arguments every call site passes for a parameter.  The flag is True when
        some binding could not be followed (a parameter with no call site, a ``for`` target, an import...)."""
        key = id(name_node)
        if key in self._values_memo:
            return self._values_memo[key]
        if key in self._busy:
            return [], False
        self._busy.add(key)
        try:
            result = self._values(name_node)
        finally:
            self._busy.discard(key)
        self._values_memo[key] = result
        return result

    def _values(self, name_node: Any) -> tuple[list, bool]:
        n = self.n
        if isinstance(name_node, n.Attribute):
            return self._attr_values(name_node)
        if not isinstance(name_node, n.Name):
            return [], True
        if name_node.name not in self.bound:  # a builtin or undefined: never make astroid build builtins
            return [], True
        try:
            _scope, assigns = name_node.lookup(name_node.name)
        except Exception:  # noqa: BLE001 - astroid raises several kinds on odd code; treat as unknown
            return [], True
        out: list = []
        unknown = not assigns
        for a in assigns:
            if not isinstance(a, n.AssignName):
                unknown = True
                continue
            p = a.parent
            if isinstance(p, n.Arguments):
                vals, unk = self.param_values(p.parent, a.name)
                out += vals
                unknown |= unk
            elif isinstance(p, (n.Assign, n.AnnAssign, n.NamedExpr)) and p.value is not None:
                out.append(p.value)
            elif isinstance(p, (n.Tuple, n.List)):
                v = self._unpacked(a)
                if v is None:
                    unknown = True
                else:
                    out += v
            else:
                unknown = True
        return out, unknown

    def _attr_values(self, attr: Any) -> tuple[list, bool]:
        """``self.x``: what the methods of its class assign to ``self.x`` (``self.gpu_id = int(os.environ[..])``)."""
        n = self.n
        if not (isinstance(attr.expr, n.Name) and attr.expr.name == "self"):
            return [], True
        frame = attr.scope()
        cls = frame.parent.frame() if isinstance(frame, n.FunctionDef) and frame.parent is not None else None
        if not isinstance(cls, n.ClassDef):
            return [], True
        out: list = []
        found = False
        for a in cls.nodes_of_class(n.AssignAttr):
            if a.attrname != attr.attrname or not (isinstance(a.expr, n.Name) and a.expr.name == "self"):
                continue
            found = True
            p = a.parent
            if isinstance(p, (n.Assign, n.AnnAssign)) and p.value is not None:
                out.append(p.value)
            elif isinstance(p, (n.Tuple, n.List)):
                out += self._unpacked(a) or []
        return out, not found or not out

    def _unpacked(self, target: Any) -> list | None:
        """``a, b = x, y`` -> [y] for b; ``a, b = f()`` with f of this file returning tuples -> their elements."""
        n = self.n
        path: list[int] = []
        node = target
        while isinstance(node.parent, (n.Tuple, n.List)):
            path.append(node.parent.elts.index(node))
            node = node.parent
        stmt = node.parent
        if not isinstance(stmt, n.Assign):
            return None
        values = [stmt.value]
        for i in reversed(path):
            nxt = []
            for v in values:
                for e in self._sequence_sources(v):
                    if isinstance(e, (n.Tuple, n.List)) and len(e.elts) > i and \
                            not any(isinstance(x, n.Starred) for x in e.elts):
                        nxt.append(e.elts[i])
            if not nxt:
                return None
            values = nxt
        return values

    def _sequence_sources(self, v: Any) -> list:
        n = self.n
        if isinstance(v, n.Call):
            fn = self.local_function(v)
            if fn is not None:
                return [r.value for r in fn.nodes_of_class(n.Return) if r.value is not None and r.scope() is fn]
        if isinstance(v, n.Name):
            return self.values(v)[0]
        return [v]

    def local_function(self, call: Any) -> Any | None:
        """The FunctionDef of this file that ``call`` calls (``f(..)``, ``self.f(..)``), or None."""
        key = id(call)
        if key not in self._callee_memo:
            self._callee_memo[key] = self._local_function(call)
        return self._callee_memo[key]

    def _local_function(self, call: Any) -> Any | None:
        n = self.n
        if isinstance(call.func, n.Name) and call.func.name in self.bound:
            try:
                _s, assigns = call.func.lookup(call.func.name)
            except Exception:  # noqa: BLE001
                return None
            fns = [a for a in assigns if isinstance(a, n.FunctionDef)]
            classes = [a for a in assigns if isinstance(a, n.ClassDef)]
            if len(classes) == 1 and not fns:  # Model(a, b) calls Model.__init__(self, a, b)
                fns = [m for m in classes[0].body if isinstance(m, n.FunctionDef) and m.name == "__init__"]
            return fns[0] if len(fns) == 1 else None
        if isinstance(call.func, n.Attribute) and isinstance(call.func.expr, n.Name) and \
                call.func.expr.name in ("self", "cls"):
            cls = call.scope().parent.frame() if call.scope() is not None else None
            if isinstance(cls, n.ClassDef):
                for m in cls.body:
                    if isinstance(m, n.FunctionDef) and m.name == call.func.attrname:
                        return m
        return None

    def _call_index(self) -> tuple[dict[int, list], dict[str, list]]:
        """Every call of the file grouped once by the local function it calls (by id) and the mp.spawn-like calls
        by the name of the function they spawn, in file order: asking per parameter walked every call of the
        file each time (quadratic: a 10k-line script took 20 s)."""
        if self._sites is None:
            n = self.n
            sites: dict[int, list] = {}
            spawns: dict[str, list] = {}
            for c in self.calls:
                fn = self.local_function(c)
                if fn is not None:
                    sites.setdefault(id(fn), []).append(c)
                if _attr_or_name(c.func) in SPAWN_CALLS and c.args and isinstance(c.args[0], n.Name):
                    spawns.setdefault(c.args[0].name, []).append(c)
            self._sites, self._spawns = sites, spawns
        return self._sites, self._spawns

    def call_sites(self, fn: Any) -> list:
        """The calls of this file whose callee is ``fn`` (a FunctionDef), in file order."""
        return list(self._call_index()[0].get(id(fn), ()))

    def param_values(self, fn: Any, param: str) -> tuple[list, bool]:
        """What every call site in the module passes for ``param`` of ``fn`` (its default where not passed)."""
        n = self.n
        if not isinstance(fn, n.FunctionDef):
            return [], True
        positional = [a.name for a in (fn.args.posonlyargs or []) + (fn.args.args or [])]
        is_method = isinstance(fn.parent, n.ClassDef) and not (
            fn.decorators and any(_attr_or_name(d) == "staticmethod" for d in fn.decorators.nodes))
        defaults = dict(zip(positional[len(positional) - len(fn.args.defaults or []):], fn.args.defaults or []))
        for a, d in zip(fn.args.kwonlyargs or [], fn.args.kw_defaults or []):
            if d is not None:
                defaults[a.name] = d
        out: list = []
        unknown = False
        sites = 0
        # mp.spawn(fn, args=(..)): the first parameter is the local process index
        for c in self._call_index()[1].get(fn.name, ()):
            sites += 1
            if positional and param == positional[0]:
                out.append(_LOCAL_INDEX)
            else:
                extra = next((k.value for k in c.keywords or [] if k.arg == "args"),
                             c.args[1] if len(c.args) > 1 else None)
                idx = positional.index(param) - 1 if param in positional else -1
                if isinstance(extra, n.Tuple) and 0 <= idx < len(extra.elts):
                    out.append(extra.elts[idx])
                else:
                    unknown = True
        for c in self.call_sites(fn):
            sites += 1
            params = positional[1:] if is_method else positional  # self.f(..) / Model(..) -> __init__
            if any(isinstance(a, n.Starred) for a in c.args) or any(k.arg is None for k in c.keywords or []):
                unknown = True
                continue
            got = None
            if param in params and params.index(param) < len(c.args):
                got = c.args[params.index(param)]
            for k in c.keywords or []:
                if k.arg == param:
                    got = k.value
            if got is None:
                got = defaults.get(param)
            if got is None:
                unknown = True
            else:
                out.append(got)
        if sites == 0 and defaults.get(param) is not None:  # called from elsewhere: its default is one value
            out.append(defaults[param])
        return out, unknown or sites == 0

    # ------------------------------------------------------------------ provenance
    @_memoized(frozenset())
    def prov(self, e: Any, depth: int = 0) -> frozenset[str]:
        """{"rank"} (global), {"local"}, both, or empty: where the value of expression ``e`` comes from
        ({"spawn"}: the process index mp.spawn passes, a local index that only a single-node script uses as its
        rank: a fine device, not a rank-0 test either way)."""
        n = self.n
        if e is _LOCAL_INDEX:  # a device index; the global rank too only on a single node: neither for rank 0
            return frozenset({"spawn"})
        if isinstance(e, n.Name):
            vals, unknown = self.values(e)
            got = frozenset().union(*(self.prov(v, depth + 1) for v in vals)) if vals else frozenset()
            if not got and (unknown or not vals) and not any(isinstance(v, n.Const) for v in vals):
                return _spelling(e.name)
            return got
        if isinstance(e, n.Attribute):  # self.gpu_id (assigned in the class), else args.rank / cfg.local_rank
            vals, _unknown = self.values(e)
            got = frozenset().union(*(self.prov(v, depth + 1) for v in vals)) if vals else frozenset()
            return got or _spelling(e.attrname)
        if isinstance(e, n.Subscript):  # os.environ["RANK"] (not shards[rank])
            key = self.env_key(e)
            return _env_kind(key) if key else frozenset()
        if isinstance(e, n.Call):
            key = self.env_key(e)
            if key:
                return _env_kind(key)
            fn = _attr_or_name(e.func)
            if fn == "get_rank" or fn == "get_global_rank":
                return frozenset({"rank"})
            if fn in ("get_local_rank", "get_node_local_rank"):
                return frozenset({"local"})
            if fn in ("int", "str", "float", "index") and e.args:
                return self.prov(e.args[0], depth + 1)
            if isinstance(e.func, n.Attribute) and fn == "get" and self.is_environ(e.func.expr) and len(e.args) > 1:
                return self.prov(e.args[1], depth + 1)  # os.environ.get(NAME_FROM_VAR, local_rank)
            local = self.local_function(e)
            if local is not None and id(local) not in self._busy:
                self._busy.add(id(local))
                try:
                    rets = [r.value for r in local.nodes_of_class(n.Return) if r.value is not None
                            and r.scope() is local and not isinstance(r.value, (n.Tuple, n.List))]
                    return frozenset().union(*(self.prov(r, depth + 1) for r in rets)) if rets else frozenset()
                finally:
                    self._busy.discard(id(local))
            return frozenset()
        if isinstance(e, n.BinOp):
            if e.op in ("%", "//"):  # rank % device_count() is a device index; rank // n is a node index
                return frozenset()
            left, right = self.prov(e.left, depth + 1), self.prov(e.right, depth + 1)
            index = ({"local"}, {"spawn"})
            if e.op == "+" and ((left in index and isinstance(e.right, n.BinOp) and e.right.op == "*") or
                                (right in index and isinstance(e.left, n.BinOp) and e.left.op == "*")):
                return frozenset({"rank"})  # node_rank * gpus_per_node + local_rank is the global rank
            return left | right
        if isinstance(e, n.IfExp):
            return self.prov(e.body, depth + 1) | self.prov(e.orelse, depth + 1)
        if isinstance(e, n.BoolOp):
            return frozenset().union(*(self.prov(v, depth + 1) for v in e.values))
        if isinstance(e, n.NamedExpr):
            return self.prov(e.value, depth + 1)
        return frozenset()

    @_memoized(False)
    def is_environ(self, e: Any, depth: int = 0) -> bool:
        """``os.environ`` or an alias of it (``env = os.environ``, ``from os import environ as E``,
        ``dict(os.environ)``, ``os.environ.copy()``)."""
        n = self.n
        if isinstance(e, n.Attribute):
            return e.attrname == "environ"
        if isinstance(e, n.Name) and e.name in self.bound:
            try:
                _s, assigns = e.lookup(e.name)
            except Exception:  # noqa: BLE001
                return False
            for a in assigns:
                if isinstance(a, n.ImportFrom) and any(orig == "environ" and (alias or orig) == e.name
                                                       for orig, alias in a.names):
                    return True
            return any(self.is_environ(v, depth + 1) for v in self.values(e)[0])
        if isinstance(e, n.Call):
            if _attr_or_name(e.func) == "dict" and e.args:
                return self.is_environ(e.args[0], depth + 1)
            if isinstance(e.func, n.Attribute) and e.func.attrname == "copy":
                return self.is_environ(e.func.expr, depth + 1)
        return False

    def env_key(self, e: Any) -> str | None:
        """The variable name when ``e`` reads the environment: ``os.environ["X"]``, ``env.get("X", ..)``,
        ``os.getenv("X")``, ``"X" in os.environ``, or any helper called with a literal rank variable name."""
        n = self.n
        if isinstance(e, n.Subscript) and _is_str(e.slice) and self.is_environ(e.value):
            return e.slice.value
        if isinstance(e, n.Call) and e.args and _is_str(e.args[0]):
            fn = _attr_or_name(e.func)
            key = e.args[0].value
            if fn == "getenv" or (fn in ("get", "pop", "setdefault") and isinstance(e.func, n.Attribute)
                                  and self.is_environ(e.func.expr)):
                return key
            if key in RANK_ENV | LOCAL_ENV | set(SLURM_VS_TORCHRUN) | {"WORLD_SIZE"}:
                return key  # env_int("RANK"), read_env("LOCAL_RANK", 0)
        if isinstance(e, n.Compare) and _is_str(e.left) and len(e.ops) == 1 and e.ops[0][0] in ("in", "not in") \
                and self.is_environ(e.ops[0][1]):
            return e.left.value
        return None

    # ------------------------------------------------------------------ rank-0 tests and guards
    @_memoized(None)
    def zero_test(self, t: Any, depth: int = 0) -> Test | None:
        """("rank"|"local", positive) when ``t`` tells (global/local) rank 0 apart: positive when true exactly
        on rank 0 (``rank == 0``, ``not local_rank``, ``is_main``), negative when true elsewhere."""
        n = self.n
        if isinstance(t, n.UnaryOp) and t.op == "not":
            inner = self.zero_test(t.operand, depth + 1)
            return (inner[0], not inner[1]) if inner else None
        if isinstance(t, n.BoolOp):
            parts = [p for p in (self.zero_test(v, depth + 1) for v in t.values) if p]
            pos = [w for w, s in parts if s]
            neg = [w for w, s in parts if not s]
            if t.op == "and":
                if pos:  # local_rank == 0 and rank == 0 holds on global rank 0 only
                    return ("rank" if "rank" in pos else "local", True)
                if neg and len(neg) == len(t.values):
                    return ("local" if "local" in neg else "rank", False)
            else:
                if neg:  # if local_rank != 0 or x: return  ->  what follows runs on local rank 0
                    return ("rank" if "rank" in neg else "local", False)
                if pos and len(pos) == len(t.values):
                    return ("local" if "local" in pos else "rank", True)
            return None
        if isinstance(t, n.Compare) and len(t.ops) == 1 and t.ops[0][0] in ("in", "not in") and \
                isinstance(t.ops[0][1], (n.Tuple, n.List, n.Set)):  # args.local_rank in [-1, 0]
            values = [e.value for e in t.ops[0][1].elts if isinstance(e, n.Const)]
            who = self._who(t.left)
            if who and 0 in values and not any(isinstance(v, int) and v > 0 for v in values):
                return (who, t.ops[0][0] == "in")
            return None
        if isinstance(t, (n.Attribute, n.Call)):  # accelerator.is_local_main_process, trainer.is_world_process_zero()
            attr = _attr_or_name(t.func if isinstance(t, n.Call) else t)
            if attr in MAIN_PROCESS_NAMES and not (isinstance(t, n.Call) and self.local_function(t) is not None):
                return (MAIN_PROCESS_NAMES[attr], True)
        if isinstance(t, n.Compare) and len(t.ops) == 1:
            op, right = t.ops[0]
            for value, const, flip in ((t.left, right, False), (right, t.left, True)):
                if not (isinstance(const, n.Const) and const.value in (0, 1, "0") and
                        not isinstance(const.value, bool)):
                    continue
                who = self._who(value)
                if who is None:
                    continue
                o = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}.get(op, op) if flip else op
                c = 0 if const.value in (0, "0") else 1
                if (c, o) in ((0, "=="), (0, "is"), (0, "<="), (1, "<")):
                    return (who, True)
                if (c, o) in ((0, "!="), (0, "is not"), (0, ">"), (1, ">=")):
                    return (who, False)
            return None
        if isinstance(t, (n.Name, n.Attribute)):  # a flag (is_main = local_rank == 0), `if rank:`
            vals, _unknown = self.values(t)
            tests = [self.zero_test(v, depth + 1) for v in vals]
            if vals and all(tests) and len({s for _, s in tests}) == 1:
                return ("local" if any(w == "local" for w, _ in tests) else "rank", tests[0][1])
            who = self._who(t)
            return (who, False) if who else None
        if isinstance(t, n.Call):
            local = self.local_function(t)
            if local is not None and id(local) not in self._busy:
                self._busy.add(id(local))
                try:
                    rets = [r.value for r in local.nodes_of_class(n.Return) if r.value is not None
                            and r.scope() is local]
                    tests = [self.zero_test(r, depth + 1) for r in rets]
                    if rets and all(tests) and len({s for _, s in tests}) == 1:
                        return ("local" if any(w == "local" for w, _ in tests) else "rank", tests[0][1])
                finally:
                    self._busy.discard(id(local))
                return None
            who = self._who(t)
            return (who, False) if who else None
        return None

    def _who(self, e: Any) -> str | None:
        p = self.prov(e)
        return "local" if "local" in p else "rank" if "rank" in p else None

    def guards(self, node: Any) -> list[Test]:
        """The rank-0 tests under which ``node`` runs within its function: enclosing ``if``/``else`` and
        conditional expressions, earlier ``if <test>: return`` exits and ``assert`` statements."""
        n = self.n
        out: list[Test] = []
        cur = node
        while cur.parent is not None and not isinstance(cur, (n.FunctionDef, n.Lambda, n.ClassDef)):
            p = cur.parent
            if isinstance(p, (n.If, n.IfExp, n.While)) and cur is not p.test:
                t = self.zero_test(p.test)
                if t:
                    in_else = isinstance(p, (n.If, n.IfExp)) and (
                        cur is p.orelse or (isinstance(p.orelse, list) and any(x is cur for x in p.orelse)))
                    out.append((t[0], t[1] != in_else))
            for field in ("body", "orelse", "finalbody"):
                seq = getattr(p, field, None)
                if isinstance(seq, list) and any(x is cur for x in seq):
                    for s in seq[:[i for i, x in enumerate(seq) if x is cur][0]]:
                        if isinstance(s, n.If) and (_exits(s.body) or _exits(s.orelse)):
                            t = self.zero_test(s.test)
                            if t and _exits(s.body) and not _exits(s.orelse):
                                out.append((t[0], not t[1]))
                            elif t and _exits(s.orelse) and not _exits(s.body):
                                out.append(t)
                        elif isinstance(s, n.Assert):
                            t = self.zero_test(s.test)
                            if t:
                                out.append(t)
            cur = p
        return out

    # ------------------------------------------------------------------ helpers
    def add(self, node: Any, kind: str, message: str) -> None:
        line = getattr(node, "lineno", 0) or 0
        if (line, kind) in self._seen:
            return
        self._seen.add((line, kind))
        self.findings.append(Finding(self.path, line, kind, message, FIXES[kind]))

    def _cuda_string_with_rank(self, e: Any) -> bool:
        n = self.n
        # a device string puts the rank right after "cuda:"; a status line that mentions cuda and the rank
        # (print(f"rank {rank}: cuda_available=...")) is text, not a device
        if isinstance(e, n.JoinedStr):
            vals = list(e.values)
            return any(isinstance(v, n.FormattedValue) and "rank" in self.prov(v.value) and i > 0
                       and _is_str(vals[i - 1]) and _DEVICE_PREFIX.search(vals[i - 1].value)
                       for i, v in enumerate(vals))
        if isinstance(e, n.BinOp) and e.op in ("+", "%"):  # "cuda:" + str(rank), "cuda:%d" % rank
            if _is_str(e.left) and (_DEVICE_PREFIX.search(e.left.value) if e.op == "+"
                                    else _DEVICE_PERCENT.search(e.left.value)):
                return "rank" in self.prov(e.right) or (
                    isinstance(e.right, n.Tuple) and any("rank" in self.prov(x) for x in e.right.elts))
        if isinstance(e, n.Call) and isinstance(e.func, n.Attribute) and e.func.attrname == "format" and \
                _is_str(e.func.expr) and _DEVICE_FORMAT.search(e.func.expr.value):
            return any("rank" in self.prov(a) for a in e.args) or \
                any("rank" in self.prov(k.value) for k in e.keywords or [])
        return False

    @_memoized(False)
    def cuda_check(self, test: Any, depth: int = 0) -> bool:
        """``test`` asks whether CUDA is usable: ``torch.cuda.is_available()``, ``device_count()``, or a name
        whose value does (``use_cuda = torch.cuda.is_available()``; ``device.type == "cuda"`` with such a
        device)."""
        n = self.n
        for x in [test, *test.nodes_of_class((n.Attribute, n.Name, n.Const))]:
            if isinstance(x, n.Attribute) and x.attrname in ("is_available", "device_count", "is_cuda"):
                return True
            if _is_str(x) and x.value.lower() in ("cuda", "cpu", "gpu"):  # device == "cuda": the user's switch
                return True
            if isinstance(x, n.Name):
                if x.name in ("is_available", "device_count"):
                    return True
                if any(self.cuda_check(v, depth + 1) for v in self.values(x)[0] if v is not _LOCAL_INDEX):
                    return True
        return False

    def _refusal_before(self, call: Any) -> bool:
        """A GPU-only script says so before ``call``: ``if not torch.cuda.is_available(): sys.exit(..)``
        (raise/return), ``assert torch.cuda.is_available()``, in the call's function or at module level."""
        n = self.n
        scopes = []
        s = call.scope()
        while s is not None:
            scopes.append(s)
            s = s.parent.scope() if s.parent is not None else None
        for stmt in self.module.nodes_of_class((n.If, n.Assert)):
            if not any(stmt.scope() is sc for sc in scopes):
                continue
            # a module-level refusal runs before any function is called (if __name__ == "__main__": check; main())
            if stmt.lineno >= call.lineno and not (stmt.scope() is self.module and call.scope() is not self.module):
                continue
            if isinstance(stmt, n.Assert) and self.cuda_check(stmt.test):
                return True
            if isinstance(stmt, n.If) and self.cuda_check(stmt.test) and (_exits(stmt.body) or _exits(stmt.orelse)):
                return True
        return False

    def _under_cuda_check(self, node: Any, stop: Any = None) -> bool:
        n = self.n
        cur = node
        while cur.parent is not None and cur is not stop:
            p = cur.parent
            if isinstance(p, (n.If, n.IfExp, n.While)) and cur is not p.test and self.cuda_check(p.test):
                return True
            cur = p
        return False

    @_memoized([])
    def nccl_sources(self, e: Any, depth: int = 0) -> list:
        """The places an ``"nccl"`` backend value comes from that no CUDA check guards."""
        n = self.n
        if e is _LOCAL_INDEX:
            return []
        if _is_str(e):
            return [e] if e.value.strip().lower() == "nccl" else []
        if isinstance(e, n.Attribute):
            return [e] if e.attrname == "NCCL" else []
        if isinstance(e, n.Call) and _attr_or_name(e.func) in ("Backend", "str") and e.args:
            return self.nccl_sources(e.args[0], depth + 1)
        if isinstance(e, n.Call) and len(e.args) > 1 and (
                (_attr_or_name(e.func) == "get" and isinstance(e.func, n.Attribute) and self.is_environ(e.func.expr))
                or _attr_or_name(e.func) == "getenv"):
            # os.environ.get("BACKEND", "nccl"): nccl wherever the variable is unset
            return self.nccl_sources(e.args[1], depth + 1)
        if isinstance(e, n.IfExp):
            if self.cuda_check(e.test):
                return []
            return self.nccl_sources(e.body, depth + 1) + self.nccl_sources(e.orelse, depth + 1)
        if isinstance(e, n.Name):
            out = []
            for v in self.values(e)[0]:
                out += [s for s in self.nccl_sources(v, depth + 1) if not self._under_cuda_check(s)]
            return out
        return []

    # ------------------------------------------------------------------ work (writes, prints, downloads)
    def work(self, c: Any) -> tuple[str, str] | None:
        """("write"|"print"|"download", description) when call ``c`` is such work."""
        n = self.n
        fn = _attr_or_name(c.func)
        if fn not in _WORK_NAMES and not any(k.arg == "download" for k in c.keywords or []):
            return None
        desc = c.as_string()
        desc = desc if len(desc) <= 60 else desc[:57] + "..."
        if fn in DOWNLOAD_CALLS or any(k.arg == "download" and isinstance(k.value, n.Const) and k.value.value is True
                                       for k in c.keywords or []):
            return ("download", desc)
        if fn in WRITE_CALLS:
            return ("write", desc)
        if fn in DUMP_CALLS and len(c.args) >= 2:
            return ("write", desc)
        if fn == "open":
            args = c.args if isinstance(c.func, n.Name) else [None, *c.args]
            mode = args[1] if len(args) > 1 else next((k.value for k in c.keywords or [] if k.arg == "mode"), None)
            if _is_str(mode) and any(ch in mode.value for ch in "wax+"):
                return ("write", desc)
        if fn == "print" and isinstance(c.func, n.Name):
            results = [a for a in c.args if not _is_str(a) and not (
                isinstance(a, n.JoinedStr) and not any(isinstance(v, n.FormattedValue) for v in a.values))]
            if results:
                return ("print", desc)
        return None

    def fn_work(self, fn: Any, depth: int = 0) -> list[tuple[str, str, int]]:
        """Work a function of this file does with no rank-0 guard of its own (through the helpers it calls)."""
        key = id(fn)
        if key in self._work_memo:
            return self._work_memo[key]
        self._work_memo[key] = []
        out = []
        for c in fn.nodes_of_class(self.n.Call):
            if c.scope() is not fn or self.guards(c):
                continue
            w = self.work(c)
            if w:
                out.append((w[0], w[1], c.lineno))
                continue
            callee = self.local_function(c)
            if callee is not None and depth < 4:
                out += [(k, d, c.lineno) for k, d, _ in self.fn_work(callee, depth + 1)]
        self._work_memo[key] = out
        return out

    # ------------------------------------------------------------------ rules
    def check(self) -> list[Finding]:
        n = self.n
        for c in self.calls:
            self._device(c)
            self._backend(c)
            self._rank0_work(c)
        for e in self.module.nodes_of_class((n.JoinedStr, n.BinOp)):
            if self._cuda_string_with_rank(e):
                self.add(e, "device-from-rank", f"device string {e.as_string()} is built from the global rank")
        self._slurm_env()
        from broker.lint import ddp as lint_ddp
        lint_ddp.check(self)
        self.findings.sort(key=lambda f: (f.line, f.kind))
        return self.findings

    def _device(self, c: Any) -> None:
        n = self.n
        fn = _attr_or_name(c.func)
        arg0 = c.args[0] if c.args else None
        if fn in ("cuda", "to", "set_device") and isinstance(c.func, n.Attribute) and "rank" in self.prov(arg0):
            self.add(c, "device-from-rank", f"{c.func.as_string()}({arg0.as_string()}) picks the GPU from the "
                     "global rank; on a second node RANK >= the number of GPUs there")
        if fn == "device":
            if len(c.args) >= 2 and _is_str(c.args[0]) and c.args[0].value == "cuda" and "rank" in self.prov(c.args[1]):
                self.add(c, "device-from-rank", f"{c.as_string()} picks the GPU from the global rank")
            elif len(c.args) == 1 and not _is_str(arg0) and "rank" in self.prov(arg0):
                self.add(c, "device-from-rank", f"{c.as_string()} is cuda:<global rank>")
            elif any(k.arg == "index" and "rank" in self.prov(k.value) for k in c.keywords or []):
                self.add(c, "device-from-rank", f"{c.as_string()} picks the GPU from the global rank")
        if self._cuda_string_with_rank(c):
            self.add(c, "device-from-rank", f"device string {c.as_string()} is built from the global rank")
        for kw in c.keywords or []:
            if kw.arg == "device_ids" and isinstance(kw.value, (n.List, n.Tuple)) and \
                    any("rank" in self.prov(x) for x in kw.value.elts):
                self.add(c, "device-from-rank", f"device_ids={kw.value.as_string()} uses the global rank")
            if kw.arg in ("device", "output_device") and "rank" in self.prov(kw.value):
                self.add(c, "device-from-rank", f"{kw.arg}={kw.value.as_string()} is the global rank")

    def _backend(self, c: Any) -> None:
        if _attr_or_name(c.func) != "init_process_group":
            return
        backend = c.args[0] if c.args else next((k.value for k in c.keywords or [] if k.arg == "backend"), None)
        if backend is None or self._under_cuda_check(c) or self._refusal_before(c):
            return
        sources = self.nccl_sources(backend)
        if sources:
            where = "" if sources[0].lineno == c.lineno else f" (set to nccl on line {sources[0].lineno})"
            self.add(c, "nccl-no-fallback", f"init_process_group({backend.as_string()}){where} uses nccl with no "
                     "CUDA check: fails on a node without a usable GPU instead of falling back to gloo")

    def _rank0_work(self, c: Any) -> None:
        w = self.work(c)
        if w is None:
            callee = self.local_function(c)
            done = self.fn_work(callee) if callee is not None else []
            if not done:
                return
            kind = "download" if all(k == "download" for k, _, _ in done) else next(
                k for k, _, _ in done if k != "download")
            first = next(x for x in done if x[0] == kind)
            w = (kind, f"{c.as_string()[:40]} (does {first[1]} on line {first[2]})")
        kind, desc = w
        g = self.guards(c)
        rank0 = any(who == "rank" and pos for who, pos in g)
        local0 = any(who == "local" and pos for who, pos in g)
        cond = self._cond_text(c)
        if kind in ("write", "print") and local0 and not rank0:
            what = "prints results" if kind == "print" else "writes"
            self.add(c, "local-rank-writes", f"`{desc}` {what} under {cond}: LOCAL_RANK 0 exists on every node, "
                     "so every node does it")
        if kind == "download" and rank0 and not local0:
            self.add(c, "download-global-rank-0", f"`{desc}` runs only under {cond}: global rank 0 is on one "
                     "host; unless the nodes share storage, the other hosts get no data")

    def _cond_text(self, c: Any) -> str:
        n = self.n
        cur = c
        while cur.parent is not None and not isinstance(cur, n.FunctionDef):
            p = cur.parent
            if isinstance(p, n.If) and cur is not p.test and self.zero_test(p.test):
                in_else = any(x is cur for x in p.orelse)
                return f"the else of `if {p.test.as_string()}`" if in_else else f"`if {p.test.as_string()}`"
            cur = p
        return "a rank-0 guard (an earlier return or flag)"

    def _slurm_env(self) -> None:
        from astroid.const import Context

        n = self.n
        reads: dict[str, list] = {}
        for e in self.module.nodes_of_class((n.Subscript, n.Call, n.Compare)):
            if getattr(e, "ctx", None) == Context.Store:  # os.environ["RANK"] = ..: a write, not a read
                continue
            key = self.env_key(e)
            if key:
                reads.setdefault(key, []).append(e)
        for slurm, torchrun in SLURM_VS_TORCHRUN.items():
            theirs = [self._key_pos(x) for x in reads.get(torchrun, [])]
            for e in reads.get(slurm, []):
                # within one function, order is precedence; a helper that reads only SLURM_* is a fallback
                # called from elsewhere, and a module-level read runs before every function
                mine = [self._key_pos(x) for x in reads.get(torchrun, []) if x.scope() is e.scope()]
                against = mine or (theirs if e.scope() is self.module else [])
                if against and self._key_pos(e) < min(against):
                    self.add(e, "slurm-env-under-torchrun", f"{slurm} is read before {torchrun}: under torchrun "
                             f"(srun .. torchrun) {slurm} counts Slurm tasks, one per node, not torchrun's workers")
                elif not theirs and self.torchrun:
                    self.add(e, "slurm-env-under-torchrun", f"{slurm} is read but this script is started by "
                             f"torchrun, which sets {torchrun}; {slurm} counts Slurm tasks, one per node")

    def _key_pos(self, e: Any) -> tuple[int, int]:
        """Where the variable's name literal of an env read stands (a nested default is read later)."""
        n = self.n
        lit = e.slice if isinstance(e, n.Subscript) else e.left if isinstance(e, n.Compare) else \
            (e.args[0] if e.args else e)
        return (lit.lineno or 0, lit.col_offset or 0)


class _LocalIndex:
    """The process index mp.spawn passes as a spawned function's first argument (a local rank)."""

    lineno = 0


_LOCAL_INDEX = _LocalIndex()


def _suppressed(findings: list[Finding], source: str) -> list[Finding]:
    lines = source.splitlines()
    out = []
    for f in findings:
        text = lines[f.line - 1] if 0 < f.line <= len(lines) else ""
        m = re.search(r"#\s*broker-lint:\s*ignore(?:\[([\w\-, ]+)\])?", text)
        if m and (m.group(1) is None or f.kind in {k.strip() for k in m.group(1).split(",")}):
            continue
        out.append(f)
    return out


class _NoImports(set):
    """A module deny-list that holds every module but ``builtins``: the lint reads one file and never follows
    its imports (astroid would otherwise parse torch to infer ``torch.backends.cudnn.benchmark = True``: 20 s)."""

    def __contains__(self, name: object) -> bool:
        return name != "builtins"


def _parse(source: str, path: str) -> Any:
    """astroid's tree for ``source``, without brain transforms and without importing anything it imports."""
    from astroid.builder import AstroidBuilder
    from astroid.manager import AstroidManager

    brain = AstroidManager.brain
    saved = brain["module_denylist"]
    brain["module_denylist"] = _NoImports()  # every AstroidManager() made while building reads it from here
    try:
        return AstroidBuilder(AstroidManager(), apply_transforms=False).string_build(source, modname="", path=path)
    finally:
        brain["module_denylist"] = saved


def lint_source(source: str, path: str = "<script>", *, launched_by_torchrun: bool = False) -> list[Finding]:
    """Findings for Python ``source`` (``path`` is used in the messages), sorted by line.  A syntax error is one
    finding of kind ``syntax-error``.  ``launched_by_torchrun``: the script is known to run under torchrun (a
    recipe's script), so any read of a SLURM_* rank variable is a finding."""
    import astroid

    try:
        module = _parse(source, path)
    except (astroid.AstroidSyntaxError, SyntaxError, ValueError) as e:
        err = getattr(e, "error", e)
        line = getattr(err, "lineno", None) or 0
        msg = getattr(err, "msg", None) or str(e).splitlines()[0]
        return [Finding(path, line, "syntax-error", f"not valid Python: {msg}", FIXES["syntax-error"])]
    return _suppressed(_Linter(module, path, launched_by_torchrun=launched_by_torchrun).check(), source)
