"""All-reduce bandwidth between the nodes: what the interconnect of a topology really gives.

Prints, per message size, the time per all_reduce and the bus bandwidth (NCCL-tests convention:
busbw = bytes * 2 * (world_size - 1) / world_size / time).  On two simulated nodes of one host NCCL uses NVLink
(P2P); give each node its own NCCL_HOSTID (the `netns` provider does) and NCCL treats them as two hosts and uses
the network transport (NET/Socket).  Runs unchanged under plain torchrun; gloo on CPU where there is no GPU.

Env: BW_SIZES_MIB (comma list, default "1,16,256"), BW_ITERS (default 20).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=float(os.environ.get("DDP_TIMEOUT_S", "300"))))
    rank, ws = dist.get_rank(), dist.get_world_size()
    print(f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={ws} device={device} backend={backend} "
          f"NCCL_HOSTID={os.environ.get('NCCL_HOSTID', '-')}", flush=True)
    sizes = [float(x) for x in os.environ.get("BW_SIZES_MIB", "1,16,256").split(",")]
    iters = int(os.environ.get("BW_ITERS", "20"))
    for mib in sizes:
        n = int(mib * 2**20 / 4)
        x = torch.ones(n, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        busbw = n * 4 * 2 * (ws - 1) / ws / dt / 1e9
        if rank == 0:
            print(f"allreduce size_mib={mib:g} time_ms={dt * 1e3:.3f} busbw_GBps={busbw:.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("BW_OK", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
