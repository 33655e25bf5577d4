"""a helper's parameter fed the global rank at its only call site."""
import os
import torch


def place(model, which):
    return model.cuda(which)  # expect: device-from-rank


place(torch.nn.Linear(2, 2), int(os.environ["RANK"]))
