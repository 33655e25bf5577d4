"""Behind an is_main = dist.get_rank() == 0 flag."""
import torch.distributed as dist
from torchvision import datasets

is_main = dist.get_rank() == 0
if is_main:
    train = datasets.CIFAR10("data", download=True)  # expect: download-global-rank-0
dist.barrier()
