"""The backend read from the environment with nccl as the default: nccl on a node without a usable GPU."""
import os

import torch.distributed as dist

dist.init_process_group(os.environ.get("DIST_BACKEND", "nccl"))  # expect: nccl-no-fallback
backend = os.getenv("BACKEND", "nccl")
dist.init_process_group(backend=backend)  # expect: nccl-no-fallback
dist.init_process_group(os.environ.get("DIST_BACKEND", "gloo"))  # ok: nccl-no-fallback
