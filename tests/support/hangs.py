"""A two-rank job that hangs in a collective, for the stall tests: rank 1 sleeps where rank 0 waits in
all_reduce, and the words the stall report must use for it."""

HANG = """\
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
print(f"rank {rank}: started", flush=True)
if rank == 1:
    time.sleep(600)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
"""
#: the stall report's verdict on :data:`HANG` written as ``train.py``
WANT = "rank 0 waits in all_reduce at train.py:9; rank 1 never called all_reduce: it is in time.sleep at train.py:8"
