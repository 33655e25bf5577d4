"""set_device straight from dist.get_rank(), and torch.device with index=."""
import torch
import torch.distributed as dist

torch.cuda.set_device(dist.get_rank())  # expect: device-from-rank
d = torch.device(type="cuda", index=dist.get_rank())  # expect: device-from-rank
