"""the old transformers examples: `args.local_rank in [-1, 0]` is true on every node's first process."""
import argparse
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=-1)
args = ap.parse_args()
if args.local_rank in [-1, 0]:
    torch.save({}, "pytorch_model.bin")  # expect: local-rank-writes
if args.local_rank not in (-1, 0):
    torch.distributed.barrier()
