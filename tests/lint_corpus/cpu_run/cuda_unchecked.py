import os

import torch

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)  # expect: cuda-without-check
model = torch.nn.Linear(4, 1).cuda()  # expect: cuda-without-check
x = torch.randn(2, 4).to("cuda")  # expect: cuda-without-check
