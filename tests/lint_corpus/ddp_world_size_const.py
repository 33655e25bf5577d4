import torch.distributed as dist

WORLD = 4
dist.init_process_group("gloo", rank=0, world_size=4)  # expect: hard-coded-world-size
dist.init_process_group("gloo", world_size=WORLD)  # expect: hard-coded-world-size
