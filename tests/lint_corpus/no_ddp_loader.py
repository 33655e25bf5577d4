import torch
from torch.utils.data import DataLoader, TensorDataset

# a single-process script: no sampler needed, one writer
data = TensorDataset(torch.randn(64, 4))
loader = DataLoader(data, batch_size=8, shuffle=True)  # ok: dataloader-no-sampler
torch.save({"n": 1}, "checkpoint.pt")  # ok: save-every-rank
