"""One bug: rank 0 evaluates through the DDP-wrapped model between epochs (its forward broadcasts BatchNorm's
buffers, a collective rank 1 never makes); rank 1 finishes and exits 0 first (run under torchrun, gloo)."""

import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    if rank == 0:
        with torch.no_grad():
            print("eval", model(torch.randn(4, 4)).mean().item(), flush=True)  # should be model.module
print("rank", rank, "done", flush=True)
