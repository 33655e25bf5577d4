"""a CUDA refusal *after* init_process_group guards nothing."""
import sys
import torch
import torch.distributed as dist

dist.init_process_group(backend="nccl")  # expect: nccl-no-fallback
if not torch.cuda.is_available():
    sys.exit("needs GPUs")
