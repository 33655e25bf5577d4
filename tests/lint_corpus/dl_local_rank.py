"""once per node (LOCAL_RANK 0), then a barrier: correct."""
import os
import torch.distributed as dist
from torchvision import datasets

local_rank = int(os.environ["LOCAL_RANK"])
if local_rank == 0:
    datasets.MNIST("data", download=True)  # ok: download-global-rank-0
dist.barrier()
