"""only global rank 0 gets past the early return."""
import torch.distributed as dist
from huggingface_hub import snapshot_download


def prepare():
    if dist.get_rank() != 0:
        return
    snapshot_download("org/model")  # expect: download-global-rank-0
