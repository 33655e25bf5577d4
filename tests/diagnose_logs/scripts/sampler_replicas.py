"""One bug: DistributedSampler built for a 4-GPU box (num_replicas=4) and run with 2 ranks: half the dataset is
never seen (run under torchrun, gloo)."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
ds = TensorDataset(torch.randn(64, 4))
sampler = DistributedSampler(ds, num_replicas=4, rank=rank)
loader = DataLoader(ds, batch_size=16, sampler=sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for (x,) in loader:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
print("rank", rank, "done", flush=True)
