"""an assignment expression in the test still carries LOCAL_RANK."""
import os
import torch

if (lr := int(os.environ["LOCAL_RANK"])) == 0:
    torch.save({"lr": lr}, "ckpt.pt")  # expect: local-rank-writes
