"""`if local_rank == 0 and rank == 0` holds on global rank 0 only: fine."""
import os
import torch

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
if local_rank == 0 and rank == 0:
    torch.save({}, "ckpt.pt")  # ok: local-rank-writes
