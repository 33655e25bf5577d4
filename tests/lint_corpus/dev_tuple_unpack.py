"""tuple unpacking: the first element is the global rank."""
import os
import torch

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
model = torch.nn.Linear(2, 2).cuda(rank)  # expect: device-from-rank
batch = 64 // world
