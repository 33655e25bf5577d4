"""One bug: the loop skips an "outlier" batch on the rank that drew it (a loss check before backward()), so that
rank makes one gradient all-reduce fewer than the others; DDP pairs the ranks' all-reduces off by one from there
(run under torchrun, gloo)."""

import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = list(torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(rank)))
if rank == 1:
    batches[2] = batches[2] * 100  # one outlier batch, on this rank only
for step, x in enumerate(batches):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    if loss.item() > 50:  # skip outliers: but DDP needs every rank's backward() for every batch
        continue
    loss.backward()
    opt.step()
print("rank", rank, "done", flush=True)
dist.destroy_process_group()
