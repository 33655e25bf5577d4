"""One bug: gradient accumulation with every micro-step inside no_sync(), so DDP never all-reduces a gradient
and each rank trains its own replica on its own data (run under torchrun, gloo; ends with exit 0)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))  # each rank its own shard
for step in range(2):
    opt.zero_grad()
    for micro in data.split(4):
        with model.no_sync():  # the last micro-step should run outside it
            model(micro).sum().backward()
    opt.step()
print("rank", rank, "done", flush=True)
