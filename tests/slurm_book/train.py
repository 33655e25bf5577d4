"""Chapter 8's training script, reduced to what the chapter shows: every rank joins the process group, all-reduces
its rank and reports where it ran.  nccl on GPUs, gloo on CPU nodes."""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1)
args = p.parse_args()
backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend=backend)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
for epoch in range(args.epochs):
    dist.all_reduce(t)
    t.fill_(float(rank))
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"rank {rank}/{world} on {socket.gethostname()}: all_reduce sum={int(total.item())} "
      f"after {args.epochs} epoch(s)", flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
