"""One bug: a hand-written data-parallel loop (no DDP) that averages gradients with all_reduce but never
broadcasts the initial weights: every rank starts from its own random weights (run under torchrun, gloo)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.Linear(4, 1)  # random init, different on every rank
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
print("rank", rank, "done", flush=True)
