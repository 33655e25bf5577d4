"""`rank` bound to LOCAL_RANK in one function and RANK in another (one name table per function)."""
import os
import torch


def setup():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)  # ok: device-from-rank


def evaluate(model):
    rank = int(os.environ["RANK"])
    return model.cuda(rank)  # expect: device-from-rank
