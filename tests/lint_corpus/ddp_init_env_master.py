import os
import torch.distributed as dist

addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}")  # ok: init-method-localhost
dist.init_process_group("gloo", init_method="env://")  # ok: init-method-localhost
