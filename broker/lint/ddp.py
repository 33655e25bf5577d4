"""Lint rules for what is statically visible in the classic DDP mistakes (registered in :mod:`broker.lint.rules`):

* ``hard-coded-world-size`` -- ``init_process_group(world_size=4)`` (a number, or a name bound only to numbers):
  the job waits for ranks torchrun never starts when it runs with another count.
* ``init-method-localhost`` -- ``init_method="tcp://localhost:..."`` / ``127.0.0.1``: on several machines every
  node looks for the rendezvous on itself.
* ``master-env-in-script`` -- ``os.environ["MASTER_ADDR"] = ...`` (or ``MASTER_PORT``, or ``os.environ.update``)
  in the script: torchrun's values are overwritten (``setdefault`` is fine).
* ``collective-under-rank0`` -- a collective (``all_reduce``, ``barrier``, ``broadcast`` ...) that only rank 0 runs
  (under ``if rank == 0``, after ``if rank != 0: return``), or a DDP model called there (its forward broadcasts
  buffers): the other ranks never join it and rank 0 hangs.
* ``dataloader-no-sampler`` -- a ``DataLoader`` without ``sampler=`` in a DDP script: every rank trains on the
  whole dataset (a rank-0-only loader, such as evaluation, is fine).
* ``set-epoch-missing`` -- a shuffling ``DistributedSampler`` whose ``set_epoch`` is never called: every epoch
  has the same order.
* ``save-every-rank`` -- ``torch.save(.., "one/path")`` that every rank runs (no rank-0 test, a path without the
  rank in it) in a DDP script.
* ``socket-ifname-in-script`` -- ``os.environ["NCCL_SOCKET_IFNAME"] = "eth0"`` (or GLOO_/TP_, or ``update``): an
  interface name of one machine written into the script.
* ``hard-coded-num-replicas`` -- ``DistributedSampler(ds, num_replicas=4)``: with another number of ranks part of
  the data is never drawn.
* ``save-every-rank`` also sees a path that is a string default argument of a helper every rank calls.
* ``cuda-without-check`` -- ``torch.cuda.set_device`` / ``.cuda()`` / ``device="cuda"`` with no
  ``torch.cuda.is_available()`` check, on a run planned for CPU only (:func:`broker.lint.script.cpu_run_findings`; not part of the
  general lint, whose scripts may be GPU-only by design).

Each rule walks the calls and assignments the linter already collected once (linear in the file), and uses the
linter's public helpers: ``add``, ``values``, ``zero_test``, ``is_environ``, ``cuda_check``.
"""

from __future__ import annotations

from typing import Any

from broker.lint.kinds import CPU_FIXES, _exits  # noqa: F401 - CPU_FIXES: read by tests and the CPU rule
from broker.lint.kinds import DDP_FIXES as FIXES

KINDS = tuple(FIXES)

COLLECTIVES = {"all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
               "all_to_all_single", "broadcast_object_list", "monitored_barrier", "gather_object",
               "scatter_object_list"}
_DIST_NAMES = {"dist", "distributed", "torch.distributed", "c10d"}
_LOCALHOST = ("localhost", "127.0.0.1", "[::1]")


def _name(func: Any) -> str | None:
    return getattr(func, "attrname", None) or getattr(func, "name", None)


def _kw(call: Any, name: str) -> Any | None:
    for k in call.keywords or []:
        if k.arg == name:
            return k.value
    return None


def _text(n: Any, e: Any) -> str:
    """The literal text of a string constant or an f-string's constant parts ('' otherwise)."""
    if isinstance(e, n.Const) and isinstance(e.value, str):
        return e.value
    if isinstance(e, n.JoinedStr):
        return "".join(v.value for v in e.values if isinstance(v, n.Const) and isinstance(v.value, str))
    return ""


def _is_dist_call(n: Any, call: Any) -> bool:
    """``dist.all_reduce(..)`` / ``torch.distributed.barrier()`` / a bare ``all_reduce`` imported by name."""
    f = call.func
    if isinstance(f, n.Attribute):
        return f.expr.as_string() in _DIST_NAMES
    return isinstance(f, n.Name)


def _int_values(L: Any, e: Any) -> bool:
    """``e`` is a number, or a name every binding of which is a number."""
    n = L.n
    if isinstance(e, n.Const):
        return isinstance(e.value, int) and not isinstance(e.value, bool)
    if isinstance(e, n.Name):
        vals, unknown = L.values(e)
        return bool(vals) and not unknown and all(isinstance(v, n.Const) and isinstance(v.value, int)
                                                  and not isinstance(v.value, bool) for v in vals)
    return False


def _rank_regions(L: Any) -> tuple[set[int], set[int]]:
    """(ids of calls that run on rank 0 only, ids of calls under any rank test) in one pass over the ``if``
    statements: the branch a rank-0 test selects, and what follows ``if rank != 0: return`` in its block.  One
    walk per rank test (not a walk up from every call: linear in the file for the common shapes)."""

    n = L.n
    only: set[int] = set()
    guarded: set[int] = set()

    def mark(stmts: list, rank0: bool) -> None:
        for st in stmts:
            for c in st.nodes_of_class(n.Call):
                guarded.add(id(c))
                if rank0:
                    only.add(id(c))

    for st in L.module.nodes_of_class(n.If):
        t = L.zero_test(st.test)
        if not t:
            continue
        positive = t[1]
        mark(st.body, positive)
        mark(st.orelse, not positive)
        body_exits, else_exits = _exits(st.body), _exits(st.orelse)
        if body_exits != else_exits:  # `if rank != 0: return`: what follows runs where the test is false
            seq = next((getattr(st.parent, f) for f in ("body", "orelse", "finalbody", "handlers")
                        if isinstance(getattr(st.parent, f, None), list) and
                        any(x is st for x in getattr(st.parent, f))), [])
            after = seq[[i for i, x in enumerate(seq) if x is st][0] + 1:] if seq else []
            mark(after, positive if else_exits else not positive)
    return only, guarded


def _is_ddp_script(L: Any) -> bool:
    n = L.n
    for c in L.calls:
        if _name(c.func) in ("init_process_group", "DistributedDataParallel", "DDP"):
            return True
    return any(isinstance(x, n.Name) and x.name in ("DistributedDataParallel", "DDP")
               for x in L.module.nodes_of_class(n.Name))


def _is_ddp_model(L: Any, name: Any) -> bool:
    vals, _ = L.values(name)
    return any(isinstance(v, L.n.Call) and _name(v.func) in ("DistributedDataParallel", "DDP") for v in vals
               if hasattr(v, "func"))


def check(L: Any) -> None:
    """Run every rule of this module on the linter ``L`` (findings go through ``L.add``)."""
    n = L.n
    ddp = _is_ddp_script(L)
    ddp_names = {t.name for a in L.module.nodes_of_class(n.Assign) if isinstance(a.value, n.Call)
                 and _name(a.value.func) in ("DistributedDataParallel", "DDP")
                 for t in a.targets if isinstance(t, n.AssignName)}
    samplers: list[Any] = []
    set_epoch = False
    rank0, guarded = _rank_regions(L)
    for c in L.calls:
        fn = _name(c.func)
        if fn == "init_process_group":
            ws = _kw(c, "world_size")
            if ws is not None and _int_values(L, ws):
                L.add(c, "hard-coded-world-size", f"world_size={ws.as_string()} is fixed in the script: run with "
                      "another number of ranks and init_process_group waits for ranks that never start")
            im = _kw(c, "init_method")
            if im is None and len(c.args) > 1:
                im = c.args[1]
            if im is not None:
                vals = [im]
                if isinstance(im, n.Name):
                    vals = L.values(im)[0] or [im]
                for v in vals:
                    text = _text(n, v) if hasattr(v, "as_string") else ""
                    if any(h in text for h in _LOCALHOST):
                        L.add(c, "init-method-localhost", f"init_method {text!r} names this host: on several "
                              "machines every node looks for the rendezvous on itself")
                        break
        elif fn in COLLECTIVES and _is_dist_call(n, c) and id(c) in rank0:
            L.add(c, "collective-under-rank0", f"{c.func.as_string()}() runs on rank 0 only: the other ranks never "
                  "call it, so rank 0 waits in it forever (or until the timeout)")
        elif isinstance(c.func, n.Name) and c.func.name in ddp_names and _is_ddp_model(L, c.func) \
                and id(c) in rank0:
            L.add(c, "collective-under-rank0", f"{c.func.name}(...) is a DistributedDataParallel model called on rank "
                  "0 only: its forward broadcasts buffers (BatchNorm's) to every rank, so rank 0 waits for ranks "
                  "that never call it; evaluate with model.module(...) there")
        elif fn == "DataLoader" and ddp:
            if _kw(c, "sampler") is None and _kw(c, "batch_sampler") is None and len(c.args) < 4 \
                    and id(c) not in rank0:
                L.add(c, "dataloader-no-sampler", "this DataLoader has no sampler in a DDP script: every rank "
                      "iterates the whole dataset, so the ranks train on the same data")
        elif fn == "DistributedSampler":
            nr = _kw(c, "num_replicas")
            if nr is None and len(c.args) > 1:
                nr = c.args[1]
            if nr is not None and _int_values(L, nr):
                L.add(c, "hard-coded-num-replicas", f"num_replicas={nr.as_string()} is fixed in the script: with "
                      "another number of ranks the samplers draw part of the dataset (or some samples twice)")
            shuffle = _kw(c, "shuffle")
            if not (isinstance(shuffle, n.Const) and shuffle.value is False):
                samplers.append(c)
        elif fn == "set_epoch":
            set_epoch = True
        elif fn == "save" and ddp and isinstance(c.func, n.Attribute) and c.func.expr.as_string() == "torch":
            path = c.args[1] if len(c.args) > 1 else _kw(c, "f")
            if path is not None and isinstance(path, n.Const) and isinstance(path.value, str) and id(c) not in guarded:
                L.add(c, "save-every-rank", f"torch.save to {path.value!r} runs on every rank: the ranks write one "
                      "file at the same time (or each node keeps its own copy)")
            elif isinstance(path, n.Name) and id(c) not in guarded:
                default = _default_path(L, path, guarded)
                if default is not None:
                    L.add(c, "save-every-rank", f"torch.save to {path.name} (default {default!r}) runs on every "
                          "rank that calls this function without a path: the ranks write one file at the same time")
    if samplers and not set_epoch and any(isinstance(x, n.For) for x in L.module.nodes_of_class(n.For)):
        for s in samplers:
            L.add(s, "set-epoch-missing", "DistributedSampler shuffles, but set_epoch is never called: every epoch "
                  "sees the same order")
    for a in L.module.nodes_of_class(n.Assign):
        for t in a.targets:
            if isinstance(t, n.Subscript) and L.is_environ(t.value) and _text(n, t.slice) in _IFNAMES \
                    and isinstance(a.value, n.Const):
                L.add(a, "socket-ifname-in-script", f"the script sets {_text(n, t.slice)}={a.value.value!r}: "
                      "another machine's interface has another name, and the nodes then fail to connect")
            if isinstance(t, n.Subscript) and L.is_environ(t.value) and _text(n, t.slice) in ("MASTER_ADDR",
                                                                                               "MASTER_PORT"):
                L.add(a, "master-env-in-script", f"the script sets {_text(n, t.slice)}: it overwrites the value "
                      "torchrun (and broker) gave, so the nodes may look for node 0 in the wrong place")
    for c in L.calls:
        if _name(c.func) == "update" and isinstance(c.func, n.Attribute) and L.is_environ(c.func.expr):
            keys = {k.arg for k in c.keywords or []}
            for d in c.args:
                if isinstance(d, n.Dict):
                    keys |= {_text(n, k) for k, _ in d.items}
            ifn = sorted(keys & set(_IFNAMES))
            if ifn:
                L.add(c, "socket-ifname-in-script", f"the script sets {', '.join(ifn)}: another machine's "
                      "interface has another name, and the nodes then fail to connect")
            hit = sorted(keys & {"MASTER_ADDR", "MASTER_PORT"})
            if hit:
                L.add(c, "master-env-in-script", f"the script sets {', '.join(hit)}: it overwrites the value "
                      "torchrun (and broker) gave, so the nodes may look for node 0 in the wrong place")


_IFNAMES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _default_path(L: Any, name: Any, guarded: set[int]) -> str | None:
    """The string default of parameter ``name`` of the function it is used in, when some call of that function
    that no rank test guards leaves it out (every rank then saves to the default); None otherwise."""
    n = L.n
    fn = name.scope()
    if not isinstance(fn, n.FunctionDef):
        return None
    try:
        default = fn.args.default_value(name.name)
    except Exception:  # noqa: BLE001 - astroid's NoDefault: a parameter without a default
        return None
    if not (isinstance(default, n.Const) and isinstance(default.value, str)):
        return None
    names = [a.name for a in fn.args.args or []]
    pos = names.index(name.name) if name.name in names else None
    for c in L.calls:
        if _name(c.func) != fn.name or id(c) in guarded:
            continue
        if any(k.arg == name.name for k in c.keywords or []):
            continue
        offset = 1 if names[:1] == ["self"] and isinstance(c.func, n.Attribute) else 0
        if pos is not None and len(c.args) + offset > pos:
            continue
        return default.value
    return None


# ------------------------------------------------------------------------------------------------ CPU-planned runs
def _under_check(L: Any, node: Any) -> bool:
    n = L.n
    cur = node
    while cur.parent is not None:
        p = cur.parent
        if isinstance(p, (n.If, n.IfExp, n.While)) and cur is not p.test and L.cuda_check(p.test):
            return True
        cur = p
    return False


def _cuda_uses(L: Any) -> list[tuple[Any, str]]:
    n = L.n
    out = []
    for c in L.calls:
        fn = _name(c.func)
        if fn == "set_device" and "cuda" in c.func.as_string():
            out.append((c, f"{c.func.as_string()}(...)"))
        elif fn == "cuda" and isinstance(c.func, n.Attribute) and c.func.expr.as_string() != "torch":
            out.append((c, ".cuda()"))
        elif fn in ("to", "device") and any(_text(n, a).startswith("cuda") for a in c.args):
            out.append((c, c.as_string()[:60]))
    return out
