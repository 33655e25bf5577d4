"""What the rank shim records inside a training rank (stdlib only; loaded by ``rankshim.py`` from its own folder and
shipped beside it, never importing broker): the rank's facts and their file (``_FACTS``, :func:`_save`, the saver
thread), the DDP sanity record (DataLoader passes, DistributedSampler parameters and epochs, ``torch.save`` paths),
DDP's sync points and skipped ``backward()`` calls, the sequence of collectives with the user's calling line, and
the parameter checksums written at a clean end.  Every wrapper keeps the original as ``__wrapped__`` and never lets
a recording error reach the job."""

import json
import os
import re
import sys
import threading
import time

#: the shim's files, shipped together to every node (``rankshim.py`` loads the others from its own folder)
SHIM_FILES = ("rankshim.py", "rankshim_record.py", "rankshim_stacks.py")
_HERE = os.path.dirname(os.path.abspath(__file__))
_FACTS = {}
_PATH = None  # the rank's facts file (set by rankshim.main / attach); None: nothing is written
_SAVE_LOCK = threading.Lock()


def _is_shim_file(name):
    """Whether a code file name is one of the shim's own files (its frames are never the user's)."""
    return os.path.basename(name) in SHIM_FILES and os.path.dirname(os.path.abspath(name)) == _HERE


def _save():
    # only the rank itself writes: a forked child (a DataLoader worker ends with os._exit) must not overwrite it
    if _PATH is None or _FACTS.get("pid") != os.getpid():
        return
    with _SAVE_LOCK:  # the rank's thread and the facts saver (_start_saver) share the temporary file
        tmp = "%s.%d.tmp" % (_PATH, os.getpid())
        try:
            # indented while small; once the sequence of collectives is in it, compact (json's C encoder: 1.7 ms
            # for 4000 points where the indented pure-Python one took 8 ms, twice a second, holding the GIL)
            text = json.dumps(_FACTS, indent=None if "seq" in _FACTS else 1, default=str)
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, _PATH)
        except (OSError, RuntimeError, ValueError):  # a full disk (or a dict changed mid-dump) changes nothing
            try:
                os.unlink(tmp)
            except OSError:
                pass


_USER_FILE = {}  # code filename -> whether it is the user's (not torch, not this shim, not frozen/stdlib)


def _is_user_file(name):
    u = _USER_FILE.get(name)
    if u is None:
        p = name.replace("\\", "/")
        u = not (p.startswith("<") or _is_shim_file(name) or "/torch/" in p
                 or "/site-packages/" in p or "/dist-packages/" in p or re.search(r"/lib/python3\.\d+/", p))
        _USER_FILE[name] = u
    return u


def _caller(depth=2):
    """``{"file", "line", "function"}`` of the innermost frame in the user's code above the caller's caller
    (the script's line that called a wrapped torch function); None when there is none."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    while f is not None and not _is_user_file(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return {"file": f.f_code.co_filename, "line": f.f_lineno, "function": f.f_code.co_name}


def _data():
    return _FACTS.setdefault("data", {"loaders": [], "set_epoch": 0, "saved": []})


def _batch_len(b):
    """Samples in one batch: the first dimension of its first tensor (a tensor, a tuple/list or a dict)."""
    if isinstance(b, dict):
        b = next(iter(b.values()), None)
    elif isinstance(b, (list, tuple)) and b:
        b = b[0]
    try:
        return int(b.shape[0]) if getattr(b, "shape", None) else 1
    except Exception:
        return 1


def _patch_data(torch):
    """The DDP sanity record (no script change): per DataLoader the dataset's size, the sampler's class, the
    passes and samples it yielded; DistributedSampler's parameters and set_epoch calls; the paths torch.save wrote;
    DDP's sync points and the optimizers' parameters."""
    try:
        data = sys.modules.get("torch.utils.data") or getattr(getattr(torch, "utils", None), "data", None)
        _patch_loader(data)
        _patch_ddp(torch)
        _patch_optimizer(torch)
        _patch_sampler(data)
        _patch_save(torch)
    except Exception:  # recording must never break the job
        pass


def _patch_loader(data):
    """Per DataLoader: the dataset's length, the sampler's class and index, passes, batches and samples drawn."""
    loader_cls = getattr(data, "DataLoader", None)
    if loader_cls is not None and not getattr(loader_cls.__iter__, "_broker", False):
        orig_iter = loader_cls.__iter__

        def __iter__(self):
            rec = getattr(self, "_broker_rec", None)
            if rec is None:
                try:
                    n = len(self.dataset)
                except Exception:
                    n = None
                rec = {"dataset_len": n, "sampler": type(getattr(self, "sampler", None)).__name__,
                       "passes": 0, "samples": 0, "batches": 0,
                       "sampler_index": getattr(getattr(self, "sampler", None), "_broker_sampler", None)}
                d = _data()
                if len(d["loaders"]) < 8:
                    d["loaders"].append(rec)
                try:
                    self._broker_rec = rec
                except Exception:
                    pass
            rec["passes"] += 1
            rec["samples_this_pass"] = 0
            _changed()  # written by the saver thread within _SAVE_EVERY_S, not in the loop (a write: ~2-4 ms)
            for batch in orig_iter(self):
                k = _batch_len(batch)
                rec["samples"] += k
                rec["samples_this_pass"] += k
                rec["batches"] += 1
                yield batch
            _changed()

        __iter__._broker = True
        __iter__.__wrapped__ = orig_iter
        loader_cls.__iter__ = __iter__


def _patch_sampler(data):
    """Per DistributedSampler: num_replicas, rank, dataset length, shuffle, the building line; the epochs given to
    set_epoch and the line of its first call."""
    sampler_cls = getattr(data, "DistributedSampler", None)
    if sampler_cls is not None and not getattr(sampler_cls.__init__, "_broker", False):
        orig_sampler_init = sampler_cls.__init__

        def sampler_init(self, *a, **k):
            orig_sampler_init(self, *a, **k)
            try:
                samplers = _data().setdefault("samplers", [])
                if len(samplers) < 8:
                    try:
                        n = len(self.dataset)
                    except Exception:
                        n = None
                    self._broker_sampler = len(samplers)
                    samplers.append({"num_replicas": getattr(self, "num_replicas", None),
                                     "rank": getattr(self, "rank", None), "dataset_len": n,
                                     "num_samples": getattr(self, "num_samples", None),
                                     "shuffle": getattr(self, "shuffle", None),
                                     "drop_last": getattr(self, "drop_last", None),
                                     "at": _caller(2), "epochs": []})
                    _save()
            except Exception:
                pass

        sampler_init._broker = True
        sampler_init.__wrapped__ = orig_sampler_init
        sampler_cls.__init__ = sampler_init
    if sampler_cls is not None and not getattr(sampler_cls.set_epoch, "_broker", False):
        orig_set_epoch = sampler_cls.set_epoch

        def set_epoch(self, epoch):
            _data()["set_epoch"] += 1
            try:
                i = getattr(self, "_broker_sampler", None)
                if i is not None:
                    ep = _data()["samplers"][i]["epochs"]
                    if len(ep) < 64:
                        ep.append(epoch if isinstance(epoch, int) else str(epoch))
                    if len(ep) == 1:
                        _data()["samplers"][i]["set_epoch_at"] = _caller(2)
            except Exception:
                pass
            return orig_set_epoch(self, epoch)

        set_epoch._broker = True
        set_epoch.__wrapped__ = orig_set_epoch
        sampler_cls.set_epoch = set_epoch


def _patch_save(torch):
    """The paths torch.save wrote (several ranks writing one path overwrite each other)."""
    save = getattr(torch, "save", None)
    if save is not None and not getattr(save, "_broker", False):
        def torch_save(obj, f, *a, **k):
            if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
                path = os.fsdecode(os.fspath(f))
                saved = _data()["saved"]
                if path not in saved and len(saved) < 32:
                    saved.append(path)
                    _save()
            return save(obj, f, *a, **k)

        torch_save._broker = True
        torch_save.__wrapped__ = save
        torch.save = torch_save


_ddp_sync = [False]  # a DDP forward with gradient sync ran since the last backward()
_MODELS = []  # weak references to the DDP-wrapped modules (else the optimizers' parameters), for the checksum
#: parameters summed per model at the end (the rest are counted only): a few hundred tensor sums, once
CHECKSUM_PARAMS = 256


def _keep_model(ddp):
    if getattr(ddp, "_broker_kept", False):  # once per model: this runs in every forward
        return
    try:
        ddp._broker_kept = True
    except Exception:
        pass
    import weakref
    mod = getattr(ddp, "module", None)
    if mod is None or any(r() is mod for r in _MODELS) or len(_MODELS) >= 4:
        return
    try:
        _MODELS.append(weakref.ref(mod))
    except TypeError:
        pass


def _checksums():
    """``[{"params": n, "sums": [[name, sum, sum of squares]]}]`` of every DDP-wrapped module (else of the
    parameters of the optimizers the script built): replicas that trained in sync agree to the last bits, so
    the ranks' figures compared at the end tell replicas that drifted apart."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    groups = []
    for r in _MODELS:
        mod = r()
        if mod is not None:
            groups.append(list(mod.named_parameters()))
    if not groups:
        for r in _OPTIMIZERS:
            opt = r()
            if opt is not None:
                groups.append([("group%d.param%d" % (g, i), p) for g, pg in enumerate(opt.param_groups)
                               for i, p in enumerate(pg.get("params", []))])
    out = []
    with torch.no_grad():
        for named in groups:
            sums = []
            for name, p in named[:CHECKSUM_PARAMS]:
                t = p.detach().double()
                sums.append([name, float(t.sum()), float((t * t).sum())])
            out.append({"params": len(named), "sums": sums, "from": "ddp" if _MODELS else "optimizer"})
    return out


_OPTIMIZERS = []


def _patch_optimizer(torch):
    import weakref
    opt_cls = getattr(getattr(torch, "optim", None), "Optimizer", None)
    if opt_cls is None or getattr(opt_cls.__init__, "_broker", False):
        return
    orig = opt_cls.__init__

    def __init__(self, *a, **k):
        orig(self, *a, **k)
        try:
            if len(_OPTIMIZERS) < 4:
                _OPTIMIZERS.append(weakref.ref(self))
        except Exception:
            pass

    __init__._broker = True
    __init__.__wrapped__ = orig
    opt_cls.__init__ = __init__


def _patch_ddp(torch):
    """DDP's own collectives in the rank's sequence: its forward's buffer broadcast (when it will sync buffers)
    and the gradient all-reduce of the backward() after a forward that requires gradient sync (not under
    ``no_sync()``, not under ``no_grad``)."""
    ddp = getattr(getattr(getattr(torch, "nn", None), "parallel", None), "DistributedDataParallel", None)
    if ddp is None or getattr(ddp.forward, "_broker", False):
        return
    orig_forward = ddp.forward

    def forward(self, *a, **k):
        try:
            _keep_model(self)
            will = getattr(self, "will_sync_module_buffers", None)
            if will is None or will():
                _sequence("DDP forward (buffer broadcast)", None)
            if torch.is_grad_enabled():
                sync = bool(getattr(self, "require_backward_grad_sync", True))
                c = _FACTS.get("ddp")
                if c is None:
                    c = _FACTS["ddp"] = {"forwards_synced": 0, "forwards_no_sync": 0, "backwards_synced": 0}
                if sync and _ddp_sync[0]:
                    _skipped_backward(c)
                _ddp_sync[0] = _ddp_sync[0] or sync
                c["forwards_synced" if sync else "forwards_no_sync"] += 1
        except Exception:
            pass
        return orig_forward(self, *a, **k)

    forward._broker = True
    forward.__wrapped__ = orig_forward
    ddp.forward = forward
    tensor = getattr(torch, "Tensor", None)
    if tensor is not None and not getattr(tensor.backward, "_broker", False):
        orig_backward = tensor.backward

        def backward(self, *a, **k):
            if _ddp_sync[0]:
                _ddp_sync[0] = False
                try:
                    _FACTS["ddp"]["backwards_synced"] += 1
                    _sequence("backward (DDP gradient all-reduce)", None)
                except Exception:
                    pass
            return orig_backward(self, *a, **k)

        backward._broker = True
        backward.__wrapped__ = orig_backward
        tensor.backward = backward


def _skipped_backward(c, at_exit=False):
    """A forward that requires gradient sync came after another with no backward() between them (or the rank
    ended so): that rank skipped the gradient all-reduce the others make there.  Noted with the forward's number,
    the sync points made so far and the user's line (the next forward's: in a loop, the same line)."""
    c["backwards_skipped"] = c.get("backwards_skipped", 0) + 1
    skips = c.setdefault("skipped", [])
    if len(skips) < 8:
        seq = _FACTS.get("seq") or {}
        skips.append({"forward": c.get("forwards_synced", 0), "points": seq.get("total", 0),
                      "at": None if at_exit else _caller(3), "at_exit": at_exit})
        _dirty[0] = True


#: torch.distributed calls counted per rank (the user's own calls: torch's internal ones are not patched)
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "all_to_all",
                "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list", "send", "recv")
_SAVE_EVERY_S = 0.5  # facts are rewritten at most this often by collective calls (a loop may call thousands)


def _shape(x):
    try:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return [list(x.shape), str(x.dtype).replace("torch.", "")]
        if isinstance(x, (list, tuple)) and x and hasattr(x[0], "shape"):
            return [_shape(t) for t in x[:4]]
    except Exception:
        pass
    return None


#: sync points kept per rank in order (beyond this only the total is counted): enough to find where the ranks'
#: sequences part in the first minutes of a run, a few KiB of JSON
SEQ_CAP = 4000
SIGS_CAP = 512  # distinct (op, shape, line) kept; shapes that vary per call then collapse to one per op and line
_SIGS = {}  # (op, shape, file, line) -> index into the facts' "sigs"
_saver = []  # the background saver thread, once started


def _sequence(op, shape):
    """Append one sync point (a collective, DDP's buffer broadcast or gradient all-reduce) with the user's line
    that made it to the rank's sequence: ``facts["seq"] = {"sigs": [[op, shape, file, line]], "seq": [index],
    "total": n}`` (interned signatures: a training loop's thousands of calls are a few distinct ones)."""
    at = _caller(2) or {}
    sig = (op, repr(shape) if shape is not None else None, at.get("file"), at.get("line"))
    rec = _FACTS.get("seq")
    if rec is None:
        rec = _FACTS["seq"] = {"sigs": [], "seq": [], "total": 0}
    i = _SIGS.get(sig)
    if i is None and len(rec["sigs"]) >= SIGS_CAP:  # shapes that change every call: op and line only from here
        sig = (op, "varies", sig[2], sig[3])
        shape = "varies"
        i = _SIGS.get(sig)
    new = i is None
    if new:
        i = _SIGS[sig] = len(rec["sigs"])
        rec["sigs"].append([op, shape, sig[2], sig[3], _rank_condition(sig[2], sig[3])])
    rec["total"] += 1
    if len(rec["seq"]) < SEQ_CAP:
        rec["seq"].append(i)
    _dirty[0] = True
    if new and len(rec["sigs"]) <= 64:
        _save()  # a call site seen for the first time is on disk at once (a rank may die or block right after)
    if not _saver:
        _start_saver()


_dirty = [False]
_RANK_IF = re.compile(r"^\s*(el)?if\b.*\b(rank|local_rank|is_main|is_master|main_process|get_rank)\b")


def _rank_condition(file, line):
    """``[line, text]`` of the innermost enclosing ``if`` that tests the rank (``if rank == 0:``), None when the
    call is not under one: such a collective runs on some ranks only.  Read once per distinct call site."""
    if not file or not line:
        return None
    import linecache
    try:
        src = linecache.getline(file, line)
        indent = len(src) - len(src.lstrip())
        n = line - 1
        while n > 0 and indent > 0:
            text = linecache.getline(file, n)
            if text.strip() and not text.lstrip().startswith("#"):
                ind = len(text) - len(text.lstrip())
                if ind < indent:
                    # the test itself, not a comment or a string that mentions a rank
                    if _RANK_IF.match(re.sub(r"""(['"]).*?\1""", "", text.split("#", 1)[0])):
                        return [n, text.strip()[:200]]
                    indent = ind
            n -= 1
    except Exception:
        pass
    return None


def _changed():
    """The facts changed: the saver thread writes them within _SAVE_EVERY_S (started here when not yet)."""
    _dirty[0] = True
    if not _saver:
        _start_saver()


#: the facts saver's writes take at most this share of the time (a slow disk or a loaded CPU spaces them out)
SAVE_SHARE = 0.002


def _start_saver():
    """A daemon thread that writes the facts at most twice a second while they change: a rank blocked in a
    collective (which releases the GIL) still has that collective in its facts file when the stall watch reads it.
    The pause after a write is at least 1/SAVE_SHARE times the write's own CPU time (json's encoder holds the GIL:
    4000 points of a sequence took 1.7 ms here, more on a loaded machine), so the writes stay under 0.2 %."""
    import threading

    def loop():
        pause = _SAVE_EVERY_S
        while True:
            time.sleep(pause)
            if _dirty[0]:
                _dirty[0] = False
                c0 = time.thread_time()
                try:
                    _save()
                except Exception:  # a dict changed while dumped: written on the next round
                    _dirty[0] = True
                pause = max(_SAVE_EVERY_S, (time.thread_time() - c0) / SAVE_SHARE)

    t = threading.Thread(target=loop, name="broker-facts", daemon=True)
    _saver.append(t)
    try:
        t.start()
    except RuntimeError:
        pass


def _counted(name, fn):
    """``fn`` that records, per rank, how many collectives it started, the last one's name, shapes and time, and
    the sequence of them (:func:`_sequence`)."""
    def collective(*a, **k):
        n = _FACTS.get("collectives", 0) + 1
        arg = a[0] if a else next((v for v in k.values() if hasattr(v, "shape") or isinstance(v, (list, tuple))),
                                  None)
        _FACTS["collectives"] = n
        shape = _shape(arg)
        _FACTS["last_collective"] = {"n": n, "op": name, "shape": shape, "at": time.time()}
        try:
            _sequence(name, shape)  # marks the facts dirty: the saver thread writes them within _SAVE_EVERY_S
        except Exception:  # recording must never break the job
            pass
        out = fn(*a, **k)
        _FACTS["last_collective"]["done"] = True
        return out

    collective._broker = True
    collective.__wrapped__ = fn
    collective.__name__ = getattr(fn, "__name__", name)
    collective.__doc__ = getattr(fn, "__doc__", None)
    return collective
