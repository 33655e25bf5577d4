import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
model = DDP(net)
model(torch.randn(8, 4)).sum().backward()  # ok: collective-under-rank0
if dist.get_rank() == 0:
    model.eval()
    out = model(torch.randn(8, 4))  # expect: collective-under-rank0
    out2 = model.module(torch.randn(8, 4))  # ok: collective-under-rank0
    plain = net(torch.randn(8, 4))  # ok: collective-under-rank0
