"""is_main = dist.get_rank() == 0: one writer for the whole job."""
import torch
import torch.distributed as dist

is_main = dist.get_rank() == 0
if is_main:
    torch.save({}, "ckpt.pt")  # ok: local-rank-writes
