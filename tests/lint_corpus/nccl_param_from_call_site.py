"""the backend is a parameter; its only call site passes "nccl"."""
import torch.distributed as dist


def setup(backend):
    dist.init_process_group(backend=backend)  # expect: nccl-no-fallback


setup("nccl")
