"""a rank's status line mentions cuda and the global rank: it is printed, not a device (1x H200 faults.py)."""
import os

import torch

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
print(f"rank {rank}: torch {torch.__version__} cuda_available={torch.cuda.is_available()} device_count={torch.cuda.device_count()}", flush=True)  # ok: device-from-rank
msg = "rank %d uses cuda" % rank  # ok: device-from-rank
torch.cuda.set_device(local_rank)
x = torch.zeros(1).to(f"cuda:{rank}")  # expect: device-from-rank
y = torch.zeros(1).to("cuda:%d" % rank)  # expect: device-from-rank
