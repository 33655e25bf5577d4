"""All-reduce bandwidth of the cluster's data path (NCCL on GPUs, gloo on CPU), for comparing topologies.

Prints the usual rank line, then per message size ``BENCH size_mib=.. algbw_gbps=.. busbw_gbps=..`` (GB/s, 1e9
bytes; busbw = algbw * 2 (n-1)/n as nccl-tests defines it) from rank 0, ALLREDUCE_OK / DDP_OK at the end.
Env: BENCH_SIZES_MIB (comma list, default 1,16,128,512), BENCH_ITERS (default 20).
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=float(os.environ.get("DDP_TIMEOUT_S", "300"))))
    print(f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world} device={device} backend={backend} "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '-')} "
          f"NCCL_HOSTID={os.environ.get('NCCL_HOSTID', '-')}", flush=True)
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    ok = abs(x[0].item() - world * (world + 1) / 2) < 1e-6
    print(f"RANK={rank} all_reduce_sum={x[0].item():g} {'ALLREDUCE_OK' if ok else 'ALLREDUCE_BAD'}", flush=True)
    iters = int(os.environ.get("BENCH_ITERS", "20"))
    sizes = [float(s) for s in os.environ.get("BENCH_SIZES_MIB", "1,16,128,512").split(",")]
    for mib in sizes:
        n = int(mib * 2**20 // 4)
        t = torch.ones(n, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        algbw = n * 4 / dt / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            print(f"BENCH size_mib={mib:g} time_ms={dt * 1e3:.3f} algbw_gbps={algbw:.2f} busbw_gbps={busbw:.2f}",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and ok:
        print("DDP_OK", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
