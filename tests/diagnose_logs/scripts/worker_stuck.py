"""One bug: rank 0 prepares the data shards for every rank, but the cache folder's name includes the rank, so the
DataLoader workers of rank 1 wait for shards in a folder nobody writes; rank 1 never gets a batch and rank 0 waits
in its first gradient all-reduce (run under torchrun, gloo; argument: a scratch folder)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
cache = os.path.join(sys.argv[1], f"cache-{rank}")  # should be one folder for every rank


class Shards(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        path = os.path.join(cache, f"shard{i % 4}.pt")
        while not os.path.exists(path):  # wait for rank 0 to write it
            time.sleep(0.2)
        return torch.load(path)[i // 4]


if rank == 0:
    os.makedirs(cache, exist_ok=True)
    for s in range(4):
        torch.save(torch.randn(4, 4), os.path.join(cache, f"shard{s}.pt"))
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Shards(), batch_size=4, sampler=DistributedSampler(Shards()), num_workers=2)
for x in loader:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
print("rank", rank, "done", flush=True)
