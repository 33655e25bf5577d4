import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
t = torch.ones(1)
dist.all_reduce(t)  # ok: collective-under-rank0
if rank == 0:
    print(t.item())
else:
    dist.barrier()  # ok: collective-under-rank0
if rank != 0:
    pass
dist.barrier()  # ok: collective-under-rank0
