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
import runpy
import socket
import sys
import time
import traceback



def _sibling(name):
    """A module of the shim's own folder: as part of the broker package where it is imported from there, else
    loaded from the file beside this one (a node runs ``python rankshim.py``; ``sitecustomize`` loads it by path)."""
    if __package__:
        import importlib

        return importlib.import_module("%s.%s" % (__package__, name))
    mod = sys.modules.get(name)
    if mod is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


_rec = _sibling("rankshim_record")  # what is recorded inside the rank, and its facts file
_stk = _sibling("rankshim_stacks")  # reading the ranks' stacks on the node (--dump-stacks)
_FACTS, _save, _caller, SHIM_FILES = _rec._FACTS, _rec._save, _rec._caller, _rec.SHIM_FILES
STACK_SIGNAL, dump_stacks, frame_answer = _stk.STACK_SIGNAL, _stk.dump_stacks, _stk.frame_answer
ANSWER_TAG, ANSWER_CHUNK = _stk.ANSWER_TAG, _stk.ANSWER_CHUNK
_SCRIPT_DIR = None
_HOOK_NAMES = ("torch", "torch.cuda", "torch.distributed", "torch.distributed.distributed_c10d")
#: flight-recorder entries per process group when the environment sets none (a few KiB of host memory)
FR_ENTRIES = "2000"
#: device nodes of a GPU a rank could use for NCCL: NVIDIA's control device and first GPU, ROCm's kfd (RCCL), and
#: WSL2's dxg (CUDA on Windows hosts has no /dev/nvidia*)
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
_STACK_FILE = None  # kept open: faulthandler writes to its descriptor from the signal handler


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
        _rec._patch_data(torch)
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
        for name in _rec._COLLECTIVES:
            fn = getattr(dist, name, None)
            if callable(fn) and not getattr(fn, "_broker", False):
                setattr(dist, name, _rec._counted(name, fn))


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
    mine = [fr for fr in frames if not _rec._is_shim_file(fr.filename)]
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
    if _rec._ddp_sync[0] and isinstance(_FACTS.get("ddp"), dict) and _FACTS.get("pid") == os.getpid():
        _rec._skipped_backward(_FACTS["ddp"], at_exit=True)  # the last synced forward had no backward() either
    if code == 0 and _rec._PATH is not None and (_rec._MODELS or _rec._OPTIMIZERS) \
            and _FACTS.get("pid") == os.getpid():
        try:
            _FACTS["checksums"] = _rec._checksums()
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

    try:
        torchrun_main()
    finally:
        # torchrun's own process is done once its workers are: the interpreter's last garbage collection would
        # walk every object torch created (0.25-0.5 s of CPU on the critical path of every run, measured on
        # torch 2.13 CPU) to free memory the exit frees anyway; atexit handlers and thread joins still run
        import gc

        gc.freeze()
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


def attach(facts_dir=None):
    """Rank facts and stacks on ``SIGUSR1`` for a rank this shim did not start: a user's own sbatch file starts
    its ranks itself (torchrun, srun), and the ``sitecustomize.py`` that ``broker slurm submit`` puts first on the
    job's ``PYTHONPATH`` calls this at every interpreter's start.  Only a torchrun worker (``RANK`` set) is a rank;
    its ``rank<R>.json`` goes to ``facts_dir`` (else ``$BROKER_FACTS_DIR``) with node (``BROKER_NODE_RANK``, else
    ``GROUP_RANK``, else ``SLURM_NODEID``), host, pid and script, and :func:`_arm_diagnostics` runs, so
    ``--dump-stacks`` reads it like a shimmed rank.  Returns whether it attached; never raises."""
    facts_dir = facts_dir or os.environ.get("BROKER_FACTS_DIR")
    rank = _int("RANK")
    if not facts_dir or rank is None or _rec._PATH is not None:
        return False
    try:
        os.makedirs(facts_dir, exist_ok=True)
    except OSError:
        return False
    _rec._PATH = os.path.join(facts_dir, "rank%s.json" % rank)
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
    global _SCRIPT_DIR
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
            _rec._PATH = os.path.join(facts_dir, "rank%s.json" % (rank if rank is not None else os.getpid()))
        except OSError:
            _rec._PATH = None
    node = _int("BROKER_NODE_RANK")
    _FACTS.update({
        "node": node if node is not None else _int("GROUP_RANK"), "host": socket.gethostname(), "pid": os.getpid(),
        "rank": rank, "local_rank": _int("LOCAL_RANK"), "world_size": _int("WORLD_SIZE"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "python": sys.version.split()[0], "script": script, "started": time.time(),
        "master": "%s:%s" % (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))})
    _save()
    if _rec._PATH is not None:
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
