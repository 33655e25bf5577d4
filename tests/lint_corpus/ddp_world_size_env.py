import os
import torch.distributed as dist

world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world)  # ok: hard-coded-world-size
