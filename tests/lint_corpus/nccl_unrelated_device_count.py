"""A device_count() check elsewhere in the file does not guard the backend choice."""
import torch
import torch.distributed as dist

model = torch.nn.Linear(2, 2)
if torch.cuda.device_count() > 1:
    print("several GPUs here")
dist.init_process_group(backend="nccl")  # expect: nccl-no-fallback
