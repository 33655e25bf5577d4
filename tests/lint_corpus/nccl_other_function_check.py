"""a refusal in another function does not guard this call."""
import sys
import torch
import torch.distributed as dist


def check():
    if not torch.cuda.is_available():
        sys.exit("needs GPUs")


def main():
    dist.init_process_group("nccl")  # expect: nccl-no-fallback
