"""One bug: each rank skips backward() for its one outlier batch but still calls opt.step() (SGD with momentum);
the ranks' outliers fall in different batches, so each makes as many gradient all-reduces as the other and the run
ends with exit 0, but the all-reduces in between paired different batches and the momentum steps came at
different times: the replicas end apart (run under torchrun, gloo)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
batches = list(torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(rank)))
batches[2 + 2 * rank] = batches[2 + 2 * rank] * 100  # one outlier batch per rank: batch 2 on rank 0, 4 on rank 1
for step, x in enumerate(batches):
    opt.zero_grad(set_to_none=False)
    loss = model(x).pow(2).mean()
    if loss.item() < 50:  # skip the outlier's backward(); the step below still runs
        loss.backward()
    opt.step()
print("rank", rank, "done", flush=True)
dist.destroy_process_group()
