"""Init_process_group(backend=dist.Backend.NCCL)."""
import torch.distributed as dist

dist.init_process_group(backend=dist.Backend.NCCL)  # expect: nccl-no-fallback
