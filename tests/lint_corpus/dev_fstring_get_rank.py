"""an f-string device from dist.get_rank()."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
g = dist.get_rank()
x = torch.zeros(1).to(f"cuda:{g}")  # expect: device-from-rank
