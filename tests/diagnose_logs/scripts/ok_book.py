"""A correct book-style DDP script: DistributedSampler with set_epoch, DDP, rank 0 saves (run under torchrun,
gloo).  It must end with no warning."""

import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
ds = TensorDataset(torch.randn(32, 4))
sampler = DistributedSampler(ds)
loader = DataLoader(ds, batch_size=8, sampler=sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for (x,) in loader:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".", "model.pt"))
dist.barrier()
print("rank", rank, "done", flush=True)
dist.destroy_process_group()
