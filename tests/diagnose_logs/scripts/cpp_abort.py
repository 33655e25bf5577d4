"""One bug class: a rank dies in native code (a C++ abort: no Python traceback) after some collectives (run under
torchrun, gloo)."""

import ctypes

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(2)
for step in range(3):
    dist.all_reduce(t)
if rank == 1:
    ctypes.CDLL(None).abort()  # what a native library's assertion does
dist.all_reduce(t)
print("rank", rank, "done", flush=True)
