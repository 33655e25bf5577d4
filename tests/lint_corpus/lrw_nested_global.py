"""a global-rank test nested inside a local one."""
import os
import torch

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
if local_rank == 0:
    if rank == 0:
        torch.save({}, "ckpt.pt")  # ok: local-rank-writes
