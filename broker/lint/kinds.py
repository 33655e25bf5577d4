"""What the lint rules share: every finding kind with its fix (:data:`FIXES`, the DDP rules' included), the name
tables the rules match calls and environment variables against, :class:`Finding`, and the small AST helpers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any


RANK_ENV = {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}
LOCAL_ENV = {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}
RANK_NAMES = {"rank", "global_rank", "world_rank"}
LOCAL_NAMES = {"local_rank", "localrank", "lrank"}
#: Slurm's per-task variables and the torchrun variable that must win over each
SLURM_VS_TORCHRUN = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_NPROCS": "WORLD_SIZE",
                     "SLURM_LOCALID": "LOCAL_RANK"}
DOWNLOAD_CALLS = {"download", "urlretrieve", "urlopen", "hf_hub_download", "snapshot_download", "download_url",
                  "download_and_extract_archive", "download_file_from_google_drive", "load_dataset", "wget"}
WRITE_CALLS = {"save", "save_pretrained", "save_model", "savez", "savez_compressed", "savetxt", "to_csv",
               "to_parquet", "to_json", "to_excel", "to_pickle", "to_feather", "write_text", "write_bytes",
               "save_checkpoint", "savefig", "save_state_dict", "export_chrome_trace", "export_stacks",
               "export_memory_timeline", "save_image", "imwrite", "imsave", "SummaryWriter"}
DUMP_CALLS = {"dump"}  # json.dump(obj, f) / pickle.dump / yaml.dump(obj, f): a write when given a file
#: attributes / methods that are true on one process: the job's first or each node's first
MAIN_PROCESS_NAMES = {"is_main_process": "rank", "is_world_process_zero": "rank", "is_global_zero": "rank",
                      "is_master": "rank", "is_local_main_process": "local", "is_local_process_zero": "local",
                      "is_local_master": "local", "is_local_zero": "local"}
_WORK_NAMES = DOWNLOAD_CALLS | WRITE_CALLS | DUMP_CALLS | {"open", "print"}
SPAWN_CALLS = {"spawn", "start_processes"}
EXIT_CALLS = {"exit", "_exit", "quit"}
SBATCH_SUFFIXES = {".sbatch", ".slurm", ".sh", ".bash"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", ".tox", ".mypy_cache", ".pytest_cache"}

#: Each fix: prose with the code to write in `backticks` (``broker lint`` prints each snippet verbatim on a line of
#: its own, never wrapped).
SRUN_FIX = ("start one torchrun per node through srun: `srun --nodes=$SLURM_NNODES --ntasks-per-node=1 bash -c "
            "'exec torchrun --nnodes=$SLURM_NNODES --nproc_per_node=GPUS --node_rank=$SLURM_NODEID "
            "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT train.py'` (single quotes: $SLURM_NODEID is "
            "expanded on each node; `broker slurm render RECIPE` writes the whole script)")
FIXES = {
    "device-from-rank": "pick the GPU from the local rank: `local_rank = int(os.environ['LOCAL_RANK'])`; "
                        "`torch.cuda.set_device(local_rank)`; `device = torch.device('cuda', local_rank)`",
    "nccl-no-fallback": "`backend = 'nccl' if torch.cuda.is_available() else 'gloo'`; "
                        "`dist.init_process_group(backend=backend)`",
    "local-rank-writes": "key one-writer work on the global rank: `if int(os.environ['RANK']) == 0:` "
                         "(or `dist.get_rank() == 0`)",
    "download-global-rank-0": "download once per node: `if local_rank == 0: download(...)`, then `dist.barrier()` "
                              "before every rank reads it (or download on every rank)",
    "slurm-env-under-torchrun": "read torchrun's variables first: `rank = int(os.environ['RANK'])`, "
                                "`world = int(os.environ['WORLD_SIZE'])`, "
                                "`local_rank = int(os.environ['LOCAL_RANK'])`; use "
                                "SLURM_* only when RANK is absent (a script started by srun without torchrun)",
    "syntax-error": "fix the syntax error; torchrun would fail on every rank",
    "sbatch-torchrun-not-srun": SRUN_FIX,
    "sbatch-no-node-rank": "give every node its rank: `torchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID "
                           "--master_addr=$MASTER_ADDR --master_port=$MASTER_PORT` (or a rendezvous: "
                           "`--rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT`), started by srun once "
                           "per node",
}
# the DDP rules (hard-coded world size, localhost rendezvous, collectives under rank 0, samplers, saves) live in
# their own module

DDP_FIXES = {
    "hard-coded-world-size": "let torchrun tell: `dist.init_process_group(backend)` (no world_size=/rank=), or "
                             "`world_size = int(os.environ['WORLD_SIZE'])`",
    "init-method-localhost": "drop init_method (torchrun's env:// uses MASTER_ADDR/MASTER_PORT), or "
                             "`init_method=f\"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\"`",
    "master-env-in-script": "delete the assignment (torchrun and broker set MASTER_ADDR/MASTER_PORT), or "
                            "`os.environ.setdefault('MASTER_ADDR', 'localhost')` for runs without torchrun",
    "collective-under-rank0": "call the collective on every rank (outside the `if rank == 0:`), and keep only the "
                              "printing or saving under it; evaluate a DDP model on rank 0 through `model.module`",
    "dataloader-no-sampler": "`sampler = DistributedSampler(dataset)`; "
                             "`DataLoader(dataset, batch_size=B, sampler=sampler)` (no shuffle=True beside it)",
    "set-epoch-missing": "`sampler.set_epoch(epoch)` at the start of every epoch",
    "save-every-rank": "save from one rank: `if dist.get_rank() == 0: torch.save(...)`, or put the rank in the "
                       "path",
    "socket-ifname-in-script": "delete the assignment: broker (and preflight `interface`) picks each node's "
                               "interface; set *_SOCKET_IFNAME in the recipe's env only where one is needed",
    "hard-coded-num-replicas": "`DistributedSampler(dataset)`: it reads the world size and rank from the process "
                               "group (or `num_replicas=dist.get_world_size()`)",
}
CPU_FIXES = {
    "cuda-without-check": "`if torch.cuda.is_available(): torch.cuda.set_device(local_rank)`; "
                          "`device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')`",
}

FIXES.update(DDP_FIXES)
KINDS = tuple(FIXES)


#: the text right before a device index in a device string: "cuda:" (f"cuda:{rank}", "cuda:" + str(rank))
_DEVICE_PREFIX = re.compile(r"\bcuda:\s*$")
#: "cuda:%d" % rank
_DEVICE_PERCENT = re.compile(r"\bcuda:\s*%")
#: "cuda:{}".format(rank)
_DEVICE_FORMAT = re.compile(r"\bcuda:\s*\{")


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


# ====================================================================================================== Python
def _attr_or_name(node: Any) -> str | None:
    """Last component of a called name: ``torch.cuda.set_device`` -> ``set_device``."""
    from astroid import nodes

    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Attribute):
        return node.attrname
    return None


def _is_str(node: Any) -> bool:
    from astroid import nodes

    return isinstance(node, nodes.Const) and isinstance(node.value, str)


def _spelling(name: str | None) -> frozenset[str]:
    if name is None:
        return frozenset()
    low = name.lower()
    return frozenset({"rank"}) if low in RANK_NAMES else frozenset({"local"}) if low in LOCAL_NAMES else frozenset()


def _env_kind(key: str) -> frozenset[str]:
    return frozenset({"rank"}) if key in RANK_ENV else frozenset({"local"}) if key in LOCAL_ENV else frozenset()


def _exits(stmts: list) -> bool:
    """True when a block always leaves: ends in return/raise/continue/break or sys.exit(..)."""
    from astroid import nodes

    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, (nodes.Return, nodes.Raise, nodes.Continue, nodes.Break)):
        return True
    return isinstance(last, nodes.Expr) and isinstance(last.value, nodes.Call) and \
        _attr_or_name(last.value.func) in EXIT_CALLS


def _memoized(empty: Any) -> Any:
    """Memoise a ``_Linter`` method per node: values flow through many names and call sites, and without it the
    walk is exponential (a torch file took minutes).  A node met again while its own answer is being worked out
    (a cycle: ``x = x + 1``, recursion) answers ``empty``."""

    def decorate(method: Any) -> Any:
        name = method.__name__

        @functools.wraps(method)
        def wrapper(self: Any, node: Any, depth: int = 0) -> Any:
            if node is None or depth > 150:
                return empty
            key = (name, id(node))
            if key in self._memo:
                return self._memo[key]
            self._memo[key] = empty
            result = method(self, node, depth)
            self._memo[key] = result
            return result

        return wrapper

    return decorate


Test = tuple[str, bool]  # ("rank"|"local", True when the test holds exactly on that rank 0)
