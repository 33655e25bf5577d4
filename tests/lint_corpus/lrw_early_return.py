"""An early `if int(os.environ["LOCAL_RANK"]) != 0: return` before a save."""
import os
import torch


def save(model):
    if int(os.environ["LOCAL_RANK"]) != 0:
        return
    torch.save(model.state_dict(), "ckpt.pt")  # expect: local-rank-writes
