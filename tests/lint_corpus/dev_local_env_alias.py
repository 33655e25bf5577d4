"""an os.environ alias read for LOCAL_RANK."""
import os
import torch

env = os.environ
lr = int(env["LOCAL_RANK"])
torch.cuda.set_device(lr)  # ok: device-from-rank
d = torch.device(f"cuda:{lr}")  # ok: device-from-rank
