"""Rank facts for any training script, unchanged (stdlib only: copied as-is to remote nodes; must not import broker).

torchrun runs this file instead of the user's script::

    python -m torch.distributed.run ... rankshim.py [--facts DIR] [--] train.py ARGS...

It runs ``train.py`` as ``__main__`` (``runpy.run_path``, ``sys.argv`` and ``sys.path[0]`` as if it had been
started directly) and writes one JSON file per rank, ``DIR/rank<RANK>.json`` (``--facts DIR``, else
``$BROKER_FACTS_DIR``), updated as it learns:

* at start: node (``BROKER_NODE_RANK``, else torchrun's ``GROUP_RANK``), host, pid, RANK, LOCAL_RANK, WORLD_SIZE,
  CUDA_VISIBLE_DEVICES, Python version, script, start time;
* when the script imports torch (an import hook; the shim never imports torch itself): torch / CUDA / NCCL
  versions and the GPUs visible; ``torch.cuda.set_device`` and ``torch.distributed.init_process_group`` are
  wrapped so the device the rank uses and the backend are recorded (also when set_device raises);
* on an uncaught exception: its type, message, the innermost frame in the user's code (not torch, not the
  standard library) and the time; the traceback then goes through ``sys.excepthook`` without the shim's own
  frames and the exit code is 1, as when the script runs alone (KeyboardInterrupt and other BaseExceptions are
  re-raised as they are);
* on a normal end (``sys.exit``, falling off the end, or ``os._exit``): the exit code and the time.

With a facts folder the rank also arms :mod:`faulthandler` on ``SIGUSR1``: the signal appends every thread's Python
stack to ``DIR/rank<RANK>.stack`` (a C-level handler: it answers while the rank is blocked inside a collective);
and, where the rank can see a GPU (:func:`gpu_possible`), sets ``TORCH_FR_BUFFER_SIZE``
(``TORCH_NCCL_TRACE_BUFFER_SIZE`` before torch 2.11: PyTorch's flight recorder) with NCCL's dump on a collective
timeout going to ``DIR/fr_trace_rank<RANK>`` unless the environment already chose.  ``rankshim.py --dump-stacks
DIR`` (run on the node by :mod:`broker.run.stall`) signals every live rank of DIR, or asks ``py-spy dump`` where it is
installed, and prints their stacks as JSON, framed in short tagged lines (:func:`frame_answer`).

Without a facts folder the script runs with nothing recorded.

The same file also starts torchrun itself, so that the rendezvous store listens only on ``MASTER_ADDR``::

    python rankshim.py --torchrun TORCHRUN_OPTIONS... rankshim.py [--facts DIR] [--] train.py ARGS...

is ``python -m torch.distributed.run TORCHRUN_OPTIONS... ...`` except on node 0 (``--node_rank=0``): torchrun's
static rendezvous hosts its c10d ``TCPStore`` there, and a TCPStore server listens on every interface
(``*:PORT``) whatever host it is given.  Its public ``master_listen_fd`` argument takes a socket that is already
listening; this mode hands it one bound to ``--master_addr`` (``127.0.0.1`` for local runs, node 0's private or
tunnel address otherwise).  When that address cannot be bound here, one ``broker:`` line says so and torch's
default (every interface) applies.
"""

import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import runpy
import socket
import sys
import threading
import time
import traceback

_FACTS = {}
_PATH = None
_SCRIPT_DIR = None
_HOOK_NAMES = ("torch", "torch.cuda", "torch.distributed", "torch.distributed.distributed_c10d")
#: the signal on which a rank dumps its Python stacks (torchelastic uses SIGTERM/SIGINT/SIGHUP/SIGQUIT, not this)
STACK_SIGNAL = signal.SIGUSR1
#: flight-recorder entries per process group when the environment sets none (a few KiB of host memory)
FR_ENTRIES = "2000"
#: device nodes of a GPU a rank could use for NCCL: NVIDIA's control device and first GPU, ROCm's kfd (RCCL), and
#: WSL2's dxg (CUDA on Windows hosts has no /dev/nvidia*)
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
_SAVE_LOCK = threading.Lock()
_STACK_FILE = None  # kept open: faulthandler writes to its descriptor from the signal handler


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


def _int(name):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _torch_facts(torch):
    """Versions and GPUs, read without creating a CUDA context where torch allows."""
    f = {"torch": getattr(torch, "__version__", None)}
    try:
        f["cuda_version"] = torch.version.cuda
    except Exception:
        f["cuda_version"] = None
    try:
        f["cuda_available"] = bool(torch.cuda.is_available())
        f["gpus_visible"] = int(torch.cuda.device_count()) if f["cuda_available"] else 0
    except Exception as e:  # noqa: BLE001 - a broken driver is a fact too
        f["cuda_available"], f["gpus_visible"], f["cuda_error"] = False, 0, str(e)[:300]
    try:  # torch.cuda.nccl is a submodule that `import torch` does not load
        if f.get("cuda_version"):
            import importlib
            v = importlib.import_module("torch.cuda.nccl").version()
            f["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else (str(v) if v else None)
        else:
            f["nccl_version"] = None
    except Exception:
        f["nccl_version"] = None
    return f


def _device_name(torch, device):
    try:
        if isinstance(device, int):
            return "cuda:%d" % device
        if isinstance(device, str):
            return device if ":" in device or device == "cpu" else device + ":0"
        return str(device)
    except Exception:
        return repr(device)


def _patch(done=None):
    """Wrap torch.cuda.set_device and init_process_group once they exist (idempotent); ``done``: the module whose
    import just finished (versions are read only once torch itself is fully imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if "torch" not in _FACTS and done in ("torch", None) and hasattr(torch, "__version__") \
            and hasattr(torch, "cuda"):
        try:
            _FACTS.update(_torch_facts(torch))
        except Exception:
            pass
        _FACTS["torch"] = getattr(torch, "__version__", None)
        _save()
    if done in ("torch", None):
        _patch_data(torch)
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and hasattr(cuda, "set_device") and not getattr(cuda.set_device, "_broker", False):
        orig_set = cuda.set_device

        def set_device(device, *a, **k):
            _FACTS["device"] = _device_name(torch, device)
            _FACTS["device_set_at"] = time.time()
            _save()
            return orig_set(device, *a, **k)

        set_device._broker = True
        set_device.__wrapped__ = orig_set
        cuda.set_device = set_device
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group") and \
            not getattr(dist.init_process_group, "_broker", False):
        orig_init = dist.init_process_group

        def init_process_group(*a, **k):
            backend = k.get("backend", a[0] if a else None)
            _FACTS["backend"] = str(backend) if backend else None
            if k.get("rank") is not None:  # a rank given by the script (e.g. from SLURM_PROCID), not torchrun's
                _FACTS["init_rank"] = k.get("rank")
            if k.get("world_size") is not None:
                _FACTS["init_world_size"] = k.get("world_size")
            init_method = k.get("init_method", a[1] if len(a) > 1 else None)
            if init_method:  # a rendezvous address written into the script (tcp://localhost:...)
                _FACTS["init_method"] = str(init_method)[:300]
            # MASTER_ADDR/PORT as the script left them (torchrun's are in "master"): a script that sets them
            # itself points every node at its own idea of node 0
            _FACTS["init_master"] = "%s:%s" % (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
            # the user's line: while a rank is in the rendezvous its place is read from here, not from a signal
            # (a signal interrupts the store's connect: torch logs a retry with its C++ trace each time)
            _FACTS["init_at"] = _caller()
            _FACTS["init_started"] = time.time()
            _save()
            out = orig_init(*a, **k)
            try:
                _FACTS["backend"] = str(dist.get_backend())
            except Exception:
                pass
            try:
                if "device" not in _FACTS:
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        _FACTS["device"] = "cuda:%d" % torch.cuda.current_device()
                    elif "nccl" not in str(_FACTS.get("backend")):
                        _FACTS["device"] = "cpu"
            except Exception:
                pass
            _FACTS["init_done"] = time.time()
            _save()
            return out

        init_process_group._broker = True
        init_process_group.__wrapped__ = orig_init
        dist.init_process_group = init_process_group
    if dist is not None:
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if callable(fn) and not getattr(fn, "_broker", False):
                setattr(dist, name, _counted(name, fn))


_USER_FILE = {}  # code filename -> whether it is the user's (not torch, not this shim, not frozen/stdlib)


def _is_user_file(name):
    u = _USER_FILE.get(name)
    if u is None:
        p = name.replace("\\", "/")
        u = not (p.startswith("<") or os.path.abspath(name) == os.path.abspath(__file__) or "/torch/" in p
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
    passes and samples it yielded; DistributedSampler.set_epoch calls; the paths torch.save wrote."""
    try:
        data = sys.modules.get("torch.utils.data") or getattr(getattr(torch, "utils", None), "data", None)
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
        _patch_ddp(torch)
        _patch_optimizer(torch)
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
    except Exception:  # recording must never break the job
        pass


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


class _TorchHook:
    """A meta-path finder that patches torch right after torch (or torch.distributed) has been imported."""

    def find_spec(self, name, path=None, target=None):
        if name not in _HOOK_NAMES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig = loader.exec_module

        def exec_module(module):
            orig(module)
            try:
                _patch(name)
            except Exception:  # recording must never break the job
                pass

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            pass
        return spec


def _user_frame(tb):
    """The innermost traceback frame in the user's code: under the script's folder, not a library."""
    frames = traceback.extract_tb(tb)
    mine = [fr for fr in frames if os.path.abspath(fr.filename) != os.path.abspath(__file__)]
    for fr in reversed(mine):
        p = os.path.abspath(fr.filename)
        if _SCRIPT_DIR and p.startswith(_SCRIPT_DIR + os.sep) and "site-packages" not in p:
            return {"file": os.path.relpath(p, _SCRIPT_DIR), "line": fr.lineno, "function": fr.name,
                    "code": (fr.line or "").strip()}
    if mine:
        fr = mine[-1]
        return {"file": fr.filename, "line": fr.lineno, "function": fr.name, "code": (fr.line or "").strip()}
    return None


def _record_exit(code):
    if "exit_code" in _FACTS or "exception" in _FACTS:
        return
    # the rank itself only: a forked DataLoader worker ends through os._exit too, and must not touch the weights
    if _ddp_sync[0] and isinstance(_FACTS.get("ddp"), dict) and _FACTS.get("pid") == os.getpid():
        _skipped_backward(_FACTS["ddp"], at_exit=True)  # the last synced forward had no backward() either
    if code == 0 and _PATH is not None and (_MODELS or _OPTIMIZERS) and _FACTS.get("pid") == os.getpid():
        try:
            _FACTS["checksums"] = _checksums()
        except Exception:  # recording must never break the job
            pass
    _FACTS["exit_code"] = code
    _FACTS["ended"] = time.time()
    _save()


def _record_exception(e):
    _FACTS["exception"] = {"type": type(e).__module__ + "." + type(e).__qualname__
                           if type(e).__module__ not in ("builtins", "__main__") else type(e).__qualname__,
                           "message": str(e)[:4000], "frame": _user_frame(e.__traceback__)}
    _FACTS["ended"] = time.time()
    _save()


def _listening_socket(host, port):
    """A TCP socket bound to ``host:port`` and listening (the address family of ``host``); OSError when not."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(socket.SOMAXCONN)
    except OSError:
        s.close()
        raise
    return s


def _bind_rendezvous():
    """Make torchrun's static rendezvous create its TCPStore server on a socket bound to its ``master_addr``."""
    try:
        from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as st
    except ImportError:  # no torch here: torchrun itself will say so
        return
    real = st.TCPStore

    def store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            try:
                kwargs["master_listen_fd"] = _listening_socket(host_name, port).detach()
            except OSError as e:
                print("broker: cannot bind the rendezvous to %s:%s (%s); it listens on every interface"
                      % (host_name, port, e.strerror or e), file=sys.stderr, flush=True)
        return real(host_name, port, world_size, is_master, *args, **kwargs)

    st.TCPStore = store


def _torchrun(args):
    """``python -m torch.distributed.run ARGS`` with the rendezvous bound to ``--master_addr`` on node 0."""
    opts = {}
    for a in args:
        if not a.startswith("--"):
            break  # the training script: what follows are its arguments, not torchrun's
        k, _, v = a.partition("=")
        opts[k.lstrip("-").replace("-", "_")] = v
    if opts.get("node_rank", "0") == "0" and opts.get("master_addr"):
        _bind_rendezvous()
    sys.argv = ["torchrun", *args]
    sys.path[0] = os.getcwd()  # as with -m: not this file's folder
    from torch.distributed.run import main as torchrun_main

    torchrun_main()
    return 0


#: the first torch whose flight recorder reads TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE and warns on the
#: TORCH_NCCL_* names (measured: 2.11.0+cu130 on an H200 warns "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use
#: TORCH_FR_BUFFER_SIZE"; 2.13's FlightRecorder.hpp reads {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"});
#: older ones read only the TORCH_NCCL_* names
FR_NEW_NAMES_FROM = (2, 11)


def _torch_version():
    """The installed torch's version string, read from its metadata (no torch import: the shim sets the flight
    recorder's variables before the script imports torch); None when torch is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("torch")
    except (PackageNotFoundError, ValueError):
        return None


def fr_env_names(torch_version):
    """``(buffer size variable, dump file variable)`` of the flight recorder for a torch version string such as
    ``"2.11.0+cu130"`` (None or unparsable: the old TORCH_NCCL_* names, which every torch before 2.11 reads)."""
    m = re.match(r"(\d+)\.(\d+)", torch_version or "")
    if m and (int(m.group(1)), int(m.group(2))) >= FR_NEW_NAMES_FROM:
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def gpu_possible(environ=None, devices=None):
    """False when the rank can see no GPU: ``CUDA_VISIBLE_DEVICES`` set empty or ``-1`` (broker's CPU nodes), or
    none of ``devices`` exists; True otherwise.  Without a GPU the job runs on gloo, whose flight recorder is never
    dumped (only NCCL's watchdog writes it on a collective timeout: a gloo timeout left none in
    tests/diagnose_logs/cpu/gloo_timeout), yet recording every collective cost 0.25-0.3 s of a 4.7 s two-node CPU
    run (bench/launch_overhead.py with and without it), so it is armed only where NCCL can run."""
    env = os.environ if environ is None else environ
    if env.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return any(os.path.exists(d) for d in (GPU_DEVICES if devices is None else devices))


def _arm_diagnostics(facts_dir, rank):
    """Stacks on SIGUSR1 into ``rank<R>.stack``; where a GPU is possible, the flight recorder on, its timeout dump
    into the facts folder."""
    global _STACK_FILE
    try:
        _STACK_FILE = open(os.path.join(facts_dir, "rank%s.stack" % rank), "a")
        faulthandler.register(STACK_SIGNAL, file=_STACK_FILE, all_threads=True, chain=False)
        _FACTS["stack_file"] = os.path.basename(_STACK_FILE.name)
    except (OSError, ValueError, AttributeError, RuntimeError):
        _STACK_FILE = None
    if gpu_possible():
        size_name, file_name = fr_env_names(_torch_version())
        # the user's own setting, under either name, wins
        if not any(n in os.environ for n in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")):
            os.environ[size_name] = FR_ENTRIES
        if not any(n in os.environ for n in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")):
            os.environ[file_name] = os.path.join(facts_dir, "fr_trace_rank")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _save()


_FRAME_FILES = re.compile(r'File "([^"]+)", line (\d+)|\(([^()]+):(\d+)\)\s*$', re.M)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not a rank that can answer
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _cpu_s(pid):
    """CPU seconds used so far by ``pid`` and its live children (DataLoader workers), from /proc (None when
    unreadable).  A rank blocked in a collective or a sleep uses ~none; one that computes uses a core."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def stat(p):
        with open("/proc/%s/stat" % p) as f:
            return f.read().rsplit(")", 1)[-1].split()

    try:
        fields = stat(pid)
    except (OSError, IndexError):
        return None
    total = int(fields[11]) + int(fields[12])  # utime, stime
    try:
        for name in os.listdir("/proc"):
            if name.isdigit() and name != str(pid):
                try:
                    f = stat(name)
                    if f[1] == str(pid):  # ppid
                        total += int(f[11]) + int(f[12])
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        pass
    return total / float(tick)


def _wait_s(pid):
    """Seconds the threads of ``pid`` have spent runnable but waiting for a CPU (``/proc/PID/task/*/schedstat``'s
    second field; None when unreadable).  On a loaded machine a computing rank gets little CPU but waits for it:
    CPU used plus this wait is what it asked for, whatever the load."""
    total, seen = 0, False
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for t in tasks:
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, t)) as f:
                total += int(f.read().split()[1])
                seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


def _code_lines(pid, text):
    """``{"file:line": source}`` for the frames in ``text`` (relative names resolved in the rank's own folder)."""
    import linecache
    out = {}
    for m in _FRAME_FILES.finditer(text):
        name, line = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        key = "%s:%s" % (name, line)
        if key in out or name.startswith("<"):
            continue
        path = name if os.path.isabs(name) else os.path.join("/proc/%d/cwd" % pid, name)
        code = linecache.getline(path, int(line)).strip()
        if code:
            out[key] = code[:300]
    return out


_SETS_MASTER = re.compile(r"""environ\s*\[\s*['"]MASTER_(ADDR|PORT)['"]\s*\]\s*=[^=]|"""
                         r"""(update|putenv)\s*\(.*MASTER_(ADDR|PORT)""")


def _master_lines(pid, script):
    """``[[line, source]]`` of the script's lines that set MASTER_ADDR/MASTER_PORT (``os.environ[...] = ``,
    ``os.environ.update``, ``os.putenv``; ``setdefault`` keeps torchrun's value and is not one)."""
    if not script:
        return []
    path = script if os.path.isabs(script) else os.path.join("/proc/%d/cwd" % pid, script)
    out = []
    try:
        with open(path, errors="replace") as f:
            for i, line in enumerate(f, 1):
                if _SETS_MASTER.search(line.split("#", 1)[0]):
                    out.append([i, line.strip()[:200]])
                    if len(out) >= 8:
                        break
    except OSError:
        pass
    return out


#: DataLoader workers (forked children of a rank) whose stacks are read per rank
WORKERS_CAP = 8


def _children(pid):
    """Live child pids of ``pid`` (its forked DataLoader workers, among others), from /proc."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and name != str(pid):
            try:
                with open("/proc/%s/stat" % name) as f:
                    fields = f.read().rsplit(")", 1)[-1].split()
                if fields[1] == str(pid) and fields[0] != "Z":
                    out.append(int(name))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(out)


def _catches(pid, sig):
    """Whether ``pid`` has a handler for ``sig`` (``/proc/PID/status`` SigCgt): a forked DataLoader worker keeps the
    faulthandler its rank armed; a child that exec'd another program does not, and the signal would end it."""
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _signalled_dump(path, pid, wait_s):
    """Signal ``pid`` (it appends its stacks to ``path``) and return what it appended ('' when nothing came)."""
    try:
        size = os.path.getsize(path)
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return ""
    end, last = time.time() + wait_s, None
    while time.time() < end:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            return ""
        if now > size and now == last:  # grown, and stopped growing
            break
        last = now
    try:
        with open(path, errors="replace") as f:
            f.seek(size)
            return f.read(256 * 1024)
    except OSError:
        return ""


def _worker_stacks(facts_dir, info, pyspy, wait_s=1.0):
    """``[{"pid", "text", "code"}]``: the stacks of a rank's forked DataLoader workers (a worker stuck in the
    dataset's code leaves its rank waiting for a batch).  Each worker kept the rank's faulthandler and stack file
    across the fork, so one at a time it is signalled and its dump read from the file's new end; py-spy reads
    them where it is installed.  A child that does not catch the signal (an exec'd program) is never signalled."""
    out = []
    for child in _children(info["pid"])[:WORKERS_CAP]:
        text = ""
        if pyspy:
            try:
                p = subprocess.run([pyspy, "dump", "--pid", str(child), "--full-filenames"], capture_output=True,
                                   text=True, timeout=20)
                text = p.stdout if p.returncode == 0 else ""
            except (OSError, subprocess.SubprocessError):
                text = ""
        if not text.strip() and info.get("stack_file") and _catches(child, STACK_SIGNAL):
            text = _signalled_dump(os.path.join(facts_dir, info["stack_file"]), child, wait_s)
        if text.strip():
            out.append({"pid": child, "text": text, "code": _code_lines(info["pid"], text)})
    return out


def dump_stacks(facts_dir, wait_s=3.0, use_pyspy=True):
    """Every live rank of ``facts_dir`` (from its ``rank*.json``): ``{rank: {"pid", "node", "tool", "text",
    "code"}}`` -- its Python stacks from ``py-spy dump`` when installed and allowed, else from the faulthandler the
    shim armed on SIGUSR1 (waits up to ``wait_s`` seconds for the dump to land).  A rank that has ended is
    ``{"pid", "node", "ended": True, "exit_code", "exception", "frame"}``; one that gave no stack is left out."""
    ranks, ended, ranks_in_init = {}, {}, {}
    try:
        names = sorted(os.listdir(facts_dir))
    except OSError:
        return {}
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(facts_dir, name)) as f:
                d = json.load(f)
            pid = int(d["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if d.get("host") not in (None, socket.gethostname()):
            continue  # a facts folder shared by several hosts (Slurm): another host's pid means nothing here
        if "ended" in d or not _alive(pid):
            exc = d.get("exception") or {}
            ended[str(d.get("rank", name[4:-5]))] = {"pid": pid, "node": d.get("node"), "ended": True,
                                                     "exit_code": d.get("exit_code"), "exception": exc.get("type"),
                                                     "frame": exc.get("frame"), "seq": d.get("seq")}
            continue
        if d.get("init_started") and not d.get("init_done"):
            # in the rendezvous: no signal (it would interrupt the store's connect, which torch logs and retries);
            # its place is the line that called init_process_group, with the addresses it was given
            at = d.get("init_at") if isinstance(d.get("init_at"), dict) else {}
            init = {"at": at, "master": d.get("master"), "init_master": d.get("init_master"),
                    "init_method": d.get("init_method"), "host": d.get("host")}
            if d.get("init_master") and d.get("init_master") != d.get("master"):
                init["sets_master"] = _master_lines(pid, d.get("script"))
            code = _code_lines(pid, 'File "%s", line %s' % (at.get("file"), at.get("line"))) if at else {}
            ranks_in_init[str(d.get("rank", name[4:-5]))] = {
                "pid": pid, "node": d.get("node"), "tool": "facts", "init": init, "code": code, "seq": d.get("seq"),
                "cpu_s": _cpu_s(pid), "wait_s": _wait_s(pid), "t": time.time()}
            continue
        ranks[str(d.get("rank", name[4:-5]))] = {"pid": pid, "node": d.get("node"), "stack_file": d.get("stack_file"),
                                                 "seq": d.get("seq")}
    pyspy = shutil.which("py-spy") if use_pyspy else None
    sizes = {}
    for r, info in ranks.items():
        if pyspy:
            # full file names tell the user's files from the libraries' (py-spy shortens them to the package
            # part otherwise); an older py-spy without the option gets a second call without it
            for extra in (["--full-filenames"], []):
                try:
                    p = subprocess.run([pyspy, "dump", "--pid", str(info["pid"])] + extra, capture_output=True,
                                       text=True, timeout=20)
                except (OSError, subprocess.SubprocessError):
                    break
                if p.returncode == 0 and p.stdout.strip():
                    info.update(tool="py-spy", text=p.stdout)
                    break
            if info.get("text"):
                continue
        if not info.get("stack_file"):
            continue
        path = os.path.join(facts_dir, info["stack_file"])
        try:
            sizes[r] = os.path.getsize(path)
        except OSError:
            sizes[r] = 0
        try:
            os.kill(info["pid"], STACK_SIGNAL)
        except OSError:
            sizes.pop(r)
    end = time.time() + wait_s
    pending = set(sizes)
    last = {}
    while pending and time.time() < end:
        time.sleep(0.1)
        for r in list(pending):
            try:
                size = os.path.getsize(os.path.join(facts_dir, ranks[r]["stack_file"]))
            except OSError:
                continue
            if size > sizes[r] and last.get(r) == size:  # grown, and stopped growing
                pending.discard(r)
            last[r] = size
    for r in sizes:
        try:
            with open(os.path.join(facts_dir, ranks[r]["stack_file"]), errors="replace") as f:
                f.seek(sizes[r])
                text = f.read(256 * 1024)
        except OSError:
            continue
        if text.strip():
            ranks[r].update(tool="faulthandler", text=text)
    out = dict(ended)
    out.update(ranks_in_init)
    for r, info in ranks.items():
        if info.get("text"):
            out[r] = {"pid": info["pid"], "node": info["node"], "tool": info["tool"], "text": info["text"],
                      "code": _code_lines(info["pid"], info["text"]), "cpu_s": _cpu_s(info["pid"]),
                      "seq": info.get("seq"),
                      "wait_s": _wait_s(info["pid"]),
                      "t": time.time()}
            workers = _worker_stacks(facts_dir, info, pyspy)
            if workers:
                out[r]["workers"] = workers
    return out


#: the tag of every line of a ``--dump-stacks`` answer (:func:`frame_answer`)
ANSWER_TAG = "broker-stacks"
#: characters of JSON per answer line: every line stays under the 1024 bytes that slurmstepd sends whole (a longer
#: line is cut into messages, and srun interleaves the pieces of its tasks: one answer per node, all at once)
ANSWER_CHUNK = 800


def frame_answer(text):
    """``text`` (one JSON document, ASCII, no newline) as short lines ``broker-stacks ID I/N CHUNK``: ``ID`` is
    unique to this answer and ends in the CRC-32 of ``text`` (8 hex digits), so answers of several nodes printed
    into one stream (``srun``'s tasks) are told apart and put back together whatever order their lines arrive in
    (:func:`broker.run.stall.stack_answers`)."""
    import zlib

    # host, pid and a nonce tell answers apart; the CRC-32 of the whole text, last, tells a damaged one
    ident = "%s-%d-%s-%08x" % (socket.gethostname().replace(" ", "_") or "host", os.getpid(), os.urandom(4).hex(),
                               zlib.crc32(text.encode()))
    chunks = [text[i:i + ANSWER_CHUNK] for i in range(0, len(text), ANSWER_CHUNK)] or [""]
    return "".join("%s %s %d/%d %s\n" % (ANSWER_TAG, ident, i + 1, len(chunks), c) for i, c in enumerate(chunks))


def attach(facts_dir=None):
    """Rank facts and stacks on ``SIGUSR1`` for a rank this shim did not start: a user's own sbatch file starts
    its ranks itself (torchrun, srun), and the ``sitecustomize.py`` that ``broker slurm submit`` puts first on the
    job's ``PYTHONPATH`` calls this at every interpreter's start.  Only a torchrun worker (``RANK`` set) is a rank;
    its ``rank<R>.json`` goes to ``facts_dir`` (else ``$BROKER_FACTS_DIR``) with node (``BROKER_NODE_RANK``, else
    ``GROUP_RANK``, else ``SLURM_NODEID``), host, pid and script, and :func:`_arm_diagnostics` runs, so
    ``--dump-stacks`` reads it like a shimmed rank.  Returns whether it attached; never raises."""
    global _PATH
    facts_dir = facts_dir or os.environ.get("BROKER_FACTS_DIR")
    rank = _int("RANK")
    if not facts_dir or rank is None or _PATH is not None:
        return False
    try:
        os.makedirs(facts_dir, exist_ok=True)
    except OSError:
        return False
    _PATH = os.path.join(facts_dir, "rank%s.json" % rank)
    node = next((v for v in (_int("BROKER_NODE_RANK"), _int("GROUP_RANK"), _int("SLURM_NODEID")) if v is not None),
                None)
    _FACTS.update({"node": node, "host": socket.gethostname(), "pid": os.getpid(), "rank": rank,
                   "local_rank": _int("LOCAL_RANK"), "world_size": _int("WORLD_SIZE"),
                   "python": sys.version.split()[0], "script": (sys.argv or [""])[0], "started": time.time(),
                   "attached": True})
    _save()
    _arm_diagnostics(facts_dir, rank)
    return True


#: ``sitecustomize.py`` for a job's ``PYTHONPATH`` (``broker slurm submit``): loads this file (beside it, as
#: ``rankshim.py``) under a private name and calls :func:`attach`, then runs the ``sitecustomize`` it shadows
SITECUSTOMIZE = """# broker (generated): rank facts and stacks on SIGUSR1 for the stall watch of `broker slurm submit`
import importlib.machinery, importlib.util, os, sys
_d = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("BROKER_FACTS_DIR") and os.environ.get("RANK"):
    try:
        _s = importlib.util.spec_from_file_location("_broker_rankshim", os.path.join(_d, "rankshim.py"))
        _m = importlib.util.module_from_spec(_s)
        _s.loader.exec_module(_m)
        _m.attach()
    except Exception:
        pass
# the sitecustomize this one shadows (a site-packages one, say) still runs
_s = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _d])
if _s is not None and _s.loader is not None:
    _m = importlib.util.module_from_spec(_s)
    sys.modules["sitecustomize"] = _m
    _s.loader.exec_module(_m)
"""


def main(argv):
    global _PATH, _SCRIPT_DIR
    args = list(argv[1:])
    if args[:1] == ["--torchrun"]:
        return _torchrun(args[1:])
    if len(args) >= 2 and args[0] == "--dump-stacks":
        sys.stdout.write(frame_answer(json.dumps(dump_stacks(args[1], use_pyspy="--no-py-spy" not in args))))
        sys.stdout.flush()
        return 0
    facts_dir = os.environ.get("BROKER_FACTS_DIR")
    if len(args) >= 2 and args[0] == "--facts":
        facts_dir, args = args[1], args[2:]
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: rankshim.py [--facts DIR] [--] SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = args[0]
    _SCRIPT_DIR = os.path.dirname(os.path.abspath(script))
    rank = _int("RANK")
    if facts_dir:
        try:
            os.makedirs(facts_dir, exist_ok=True)
            _PATH = os.path.join(facts_dir, "rank%s.json" % (rank if rank is not None else os.getpid()))
        except OSError:
            _PATH = None
    node = _int("BROKER_NODE_RANK")
    _FACTS.update({
        "node": node if node is not None else _int("GROUP_RANK"), "host": socket.gethostname(), "pid": os.getpid(),
        "rank": rank, "local_rank": _int("LOCAL_RANK"), "world_size": _int("WORLD_SIZE"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "python": sys.version.split()[0], "script": script, "started": time.time(),
        "master": "%s:%s" % (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))})
    _save()
    if _PATH is not None:
        _arm_diagnostics(facts_dir, rank if rank is not None else os.getpid())
    sys.meta_path.insert(0, _TorchHook())
    if "torch" in sys.modules:  # torch already imported (sitecustomize): patch now
        _patch()
    real_exit = os._exit

    def _exit(code):
        _record_exit(code)
        real_exit(code)

    os._exit = _exit
    sys.argv = args
    sys.path[0] = _SCRIPT_DIR
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        _record_exit(0 if code is None else code if isinstance(code, int) else 1)
        raise
    except BaseException as e:
        _record_exception(e)
        if not isinstance(e, Exception):  # KeyboardInterrupt & co: Python's own exit behaviour
            raise
        # the traceback as if the script had been run directly (no shim or runpy frames), through
        # sys.excepthook (torch's adds the [rankN]: prefix), and Python's exit code for an uncaught exception
        tb = e.__traceback__
        me = os.path.abspath(__file__)
        while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) == me
                                  or "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        if tb is not None:
            e.with_traceback(tb)  # the default hook prints e.__traceback__, whatever tb it is given
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    _record_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
