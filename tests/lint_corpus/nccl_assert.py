"""assert torch.cuda.is_available() before the call."""
import torch
import torch.distributed as dist

assert torch.cuda.is_available(), "GPU-only job"
dist.init_process_group(backend="nccl")  # ok: nccl-no-fallback
