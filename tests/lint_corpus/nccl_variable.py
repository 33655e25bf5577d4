"""Backend = "nccl"; dist.init_process_group(backend)."""
import torch.distributed as dist

backend = "nccl"
dist.init_process_group(backend)  # expect: nccl-no-fallback
