import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(data)  # expect: set-epoch-missing
eval_sampler = DistributedSampler(data, shuffle=False)  # ok: set-epoch-missing
loader = DataLoader(data, batch_size=8, sampler=sampler)
model = DDP(torch.nn.Linear(4, 1))
for epoch in range(3):
    for x, y in loader:
        model(x).sum().backward()
