"""DistributedSampler told a fixed number of replicas: with another number of ranks part of the data is never
drawn (or drawn twice)."""
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
ds = TensorDataset(torch.randn(8, 2))
NUM_GPUS = 4
sampler = DistributedSampler(ds, num_replicas=4, rank=dist.get_rank())  # expect: hard-coded-num-replicas
other = DistributedSampler(ds, NUM_GPUS, dist.get_rank())  # expect: hard-coded-num-replicas
fine = DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=dist.get_rank())  # ok: hard-coded-num-replicas
loader = DataLoader(ds, batch_size=2, sampler=sampler)
for epoch in range(2):
    sampler.set_epoch(epoch)
    other.set_epoch(epoch)
    fine.set_epoch(epoch)
    for batch in loader:
        pass
