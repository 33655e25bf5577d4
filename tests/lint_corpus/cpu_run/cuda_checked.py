import os

import torch

local_rank = int(os.environ["LOCAL_RANK"])
use_cuda = torch.cuda.is_available()
if use_cuda:
    torch.cuda.set_device(local_rank)  # ok: cuda-without-check
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = torch.nn.Linear(4, 1).to(device)  # ok: cuda-without-check
if torch.cuda.device_count() > 0:
    model = model.cuda()  # ok: cuda-without-check
