import os

import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "localhost")  # ok: master-env-in-script
port = os.environ["MASTER_PORT"]  # ok: master-env-in-script
os.environ["OMP_NUM_THREADS"] = "1"  # ok: master-env-in-script
dist.init_process_group("gloo")
