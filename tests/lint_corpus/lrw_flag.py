"""is_main = local_rank == 0, then if is_main: torch.save(..)."""
import os
import torch

local_rank = int(os.environ["LOCAL_RANK"])
is_main = local_rank == 0
model = torch.nn.Linear(2, 2)
if is_main:
    torch.save(model.state_dict(), "ckpt.pt")  # expect: local-rank-writes
