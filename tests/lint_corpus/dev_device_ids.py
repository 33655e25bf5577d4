"""DDP's device_ids from the global rank."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = dist.get_rank()
model = DDP(torch.nn.Linear(2, 2), device_ids=[rank])  # expect: device-from-rank
