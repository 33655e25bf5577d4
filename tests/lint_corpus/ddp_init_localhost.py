import torch.distributed as dist

URL = "tcp://127.0.0.1:23456"
dist.init_process_group("gloo", init_method="tcp://localhost:29500", rank=0, world_size=2)  # expect: init-method-localhost, hard-coded-world-size
dist.init_process_group("gloo", URL)  # expect: init-method-localhost
