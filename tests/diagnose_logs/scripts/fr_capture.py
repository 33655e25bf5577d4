"""Capture real flight-recorder dumps (tests/diagnose_logs/cpu/flight_recorder): rank 0 enqueues a second
all_reduce that rank 1 never calls; each rank writes torch's own dump (``_dump_fr_trace``, the pickle that
ProcessGroupNCCL writes to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` on a collective timeout; gloo records the same
entries in torch 2.13).

    for r in 0 1; do FR_OUT=DIR/fr_trace_rank TORCH_FR_BUFFER_SIZE=100 RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29533 python fr_capture.py & done; wait
"""
import os, torch, torch.distributed as dist
import torch._C._distributed_c10d as c
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(3)
dist.all_reduce(t)
if rank == 0:
    w = dist.all_reduce(torch.ones(4), async_op=True)   # rank 1 never calls it
    import time; time.sleep(1)
out = os.environ["FR_OUT"] + str(rank)
open(out, "wb").write(c._dump_fr_trace(True, True, False))
dist.barrier() if rank == 1 else None
os._exit(0)
