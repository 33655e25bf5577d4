import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)  # expect: dataloader-no-sampler
model = DDP(torch.nn.Linear(4, 1))
for epoch in range(3):
    for x, y in loader:
        model(x).sum().backward()
torch.save(model.state_dict(), "checkpoint.pt")  # expect: save-every-rank
