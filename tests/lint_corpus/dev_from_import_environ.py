"""from os import environ as E: an alias through an import."""
from os import environ as E

import torch

g = int(E.get("RANK", "0"))
t = torch.ones(3).to(g)  # expect: device-from-rank
