"""--local-rank from argparse (the old torch.distributed.launch convention)."""
import argparse
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
args = ap.parse_args()
torch.cuda.set_device(args.local_rank)  # ok: device-from-rank
