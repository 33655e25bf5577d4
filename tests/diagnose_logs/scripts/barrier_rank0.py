"""One bug: a barrier only rank 0 reaches ("wait for the others before logging"), inside a DDP training loop
(run under torchrun, gloo)."""

import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    if rank == 0 and step == 1:
        dist.barrier()
print("rank", rank, "done", flush=True)
