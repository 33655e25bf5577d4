"""x.cuda(rank) in a helper whose `rank` parameter receives LOCAL_RANK at every call site."""
import os
import torch


def work(model, rank):
    x = torch.randn(4, 2).cuda(rank)  # ok: device-from-rank
    return model(x)


local_rank = int(os.environ["LOCAL_RANK"])
model = torch.nn.Linear(2, 2)
work(model, local_rank)
work(model, rank=local_rank)
