"""An interface name written into the script: another machine's interface is called something else."""
import os

import torch.distributed as dist

os.environ["NCCL_SOCKET_IFNAME"] = "eth0"  # expect: socket-ifname-in-script
os.environ.update(GLOO_SOCKET_IFNAME="ens5")  # expect: socket-ifname-in-script
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ok: socket-ifname-in-script
ifname = os.environ.get("NCCL_SOCKET_IFNAME")  # ok: socket-ifname-in-script
dist.init_process_group("gloo")
