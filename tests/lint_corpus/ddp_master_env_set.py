import os
from os import environ

import torch.distributed as dist

os.environ["MASTER_ADDR"] = "localhost"  # expect: master-env-in-script
environ["MASTER_PORT"] = "12355"  # expect: master-env-in-script
os.environ.update(MASTER_PORT="29500")  # expect: master-env-in-script
dist.init_process_group("gloo")
