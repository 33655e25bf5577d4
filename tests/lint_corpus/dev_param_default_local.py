"""a parameter with no call site in the file: its default (LOCAL_RANK) is what it holds."""
import os
import torch


def main(rank=int(os.environ.get("LOCAL_RANK", 0))):
    torch.cuda.set_device(rank)  # ok: device-from-rank
