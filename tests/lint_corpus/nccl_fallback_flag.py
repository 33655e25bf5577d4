"""the choice goes through a flag that holds the CUDA check."""
import torch
import torch.distributed as dist

use_cuda = torch.cuda.is_available()
backend = "nccl" if use_cuda else "gloo"
dist.init_process_group(backend=backend)  # ok: nccl-no-fallback
