"""a documented GPU-only script: the ignore comment silences the finding on its line."""
import torch.distributed as dist

dist.init_process_group("nccl")  # broker-lint: ignore[nccl-no-fallback]  # ok: nccl-no-fallback
