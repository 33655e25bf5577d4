import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
sampler = DistributedSampler(data)  # ok: set-epoch-missing
loader = DataLoader(data, batch_size=8, sampler=sampler)  # ok: dataloader-no-sampler
model = DDP(torch.nn.Linear(4, 1))
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        model(x).sum().backward()
if dist.get_rank() == 0:
    val = DataLoader(data, batch_size=8)  # ok: dataloader-no-sampler
    torch.save(model.state_dict(), "checkpoint.pt")  # ok: save-every-rank
torch.save(model.state_dict(), f"ckpt_rank{dist.get_rank()}.pt")  # ok: save-every-rank
