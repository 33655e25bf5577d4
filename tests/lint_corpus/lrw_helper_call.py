"""a helper that writes, called under LOCAL_RANK 0: reported at the call."""
import os
import torch


def save_checkpoint_file(model, path):
    torch.save(model.state_dict(), path)


local_rank = int(os.environ["LOCAL_RANK"])
model = torch.nn.Linear(2, 2)
if local_rank == 0:
    save_checkpoint_file(model, "ckpt.pt")  # expect: local-rank-writes
