"""accelerate: is_local_main_process is each node's first process; is_main_process the job's."""
import torch
from accelerate import Accelerator

accelerator = Accelerator()
if accelerator.is_local_main_process:
    torch.save({}, "local.pt")  # expect: local-rank-writes
if accelerator.is_main_process:
    torch.save({}, "model.pt")  # ok: local-rank-writes
