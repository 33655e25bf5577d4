"""device and backend chosen together in the branches of a CUDA check."""
import os
import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():
    device, backend = torch.device("cuda", local_rank), "nccl"
else:
    device, backend = torch.device("cpu"), "gloo"
dist.init_process_group(backend=backend)  # ok: nccl-no-fallback
