"""rank-0 work in a helper whose `rank` receives LOCAL_RANK: every node writes the trace."""
import os
import torch
from torch.profiler import profile


def work(model, rank):
    with profile() as prof:
        model(torch.randn(4, 2).cuda(rank))  # ok: device-from-rank
    if rank == 0:
        prof.export_chrome_trace("trace.json")  # expect: local-rank-writes


local_rank = int(os.environ["LOCAL_RANK"])
work(torch.nn.Linear(2, 2), local_rank)
