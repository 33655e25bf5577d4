"""An alias of os.environ; the global rank picks the GPU."""
import os
import torch

env = os.environ
r = int(env["RANK"])
torch.cuda.set_device(r)  # expect: device-from-rank
