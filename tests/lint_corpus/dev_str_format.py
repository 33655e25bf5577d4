"""Torch.device("cuda:{}".format(rank)) with the global rank."""
import os
import torch

rank = int(os.environ["RANK"])
device = torch.device("cuda:{}".format(rank))  # expect: device-from-rank
