"""gloo by default, nccl only inside the CUDA branch."""
import torch
import torch.distributed as dist

backend = "gloo"
if torch.cuda.is_available():
    backend = "nccl"
dist.init_process_group(backend)  # ok: nccl-no-fallback
