"""One bug: set_epoch is called on the validation sampler, never on the training one, so every epoch trains in
the same order (run under torchrun, gloo)."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
train_ds, val_ds = TensorDataset(torch.randn(32, 4)), TensorDataset(torch.randn(8, 4))
train_sampler = DistributedSampler(train_ds)
val_sampler = DistributedSampler(val_ds, shuffle=False)
train = DataLoader(train_ds, batch_size=8, sampler=train_sampler)
val = DataLoader(val_ds, batch_size=8, sampler=val_sampler)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    val_sampler.set_epoch(epoch)  # meant for train_sampler
    for (x,) in train:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    with torch.no_grad():
        for (x,) in val:
            model.module(x)
print("rank", rank, "done", flush=True)
