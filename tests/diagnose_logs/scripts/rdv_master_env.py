"""One bug: the script points the rendezvous at its own idea of node 0 (MASTER_ADDR/PORT written into it), so
torchrun's rendezvous is never used and every rank waits in init_process_group (run under torchrun)."""

import datetime
import os

import torch
import torch.distributed as dist

os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ["MASTER_PORT"] = "29533"
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
