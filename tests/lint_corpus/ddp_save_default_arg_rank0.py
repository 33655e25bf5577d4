"""The same helper called on rank 0 only: fine."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(2, 2))


def save_checkpoint(m, path="checkpoint.pt"):
    torch.save(m.state_dict(), path)  # ok: save-every-rank


for epoch in range(2):
    if dist.get_rank() == 0:
        save_checkpoint(model)
