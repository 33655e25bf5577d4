"""A correct script: every rank preprocesses its data in its own code for PREP_S seconds (default 75), printing
nothing, before its first collective (run under torchrun).  PREP_NICE lowers the ranks' priority, as a loaded
machine would."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
os.nice(int(os.environ.get("PREP_NICE", "0")))
end = time.monotonic() + float(os.environ.get("PREP_S", "75"))
table = {}
# "tokenising": one line of work (the same stack in every sample), no output
while time.monotonic() < end: table[len(table) % 1000] = sum(range(20000))  # noqa: E701
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("rank", dist.get_rank(), "done", flush=True)
dist.destroy_process_group()
