"""os.getenv("LOCAL_RANK") == "0" compares the string."""
import os
import torch

if os.getenv("LOCAL_RANK") == "0":
    torch.save({}, "state.pt")  # expect: local-rank-writes
