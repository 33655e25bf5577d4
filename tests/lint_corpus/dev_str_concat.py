"""a device string built by concatenation."""
import os
import torch

rank = int(os.getenv("RANK", "0"))
dev = torch.device("cuda:" + str(rank))  # expect: device-from-rank
