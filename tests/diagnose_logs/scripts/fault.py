"""One classic distributed-training fault per MODE, as a learner would write it (run under torchrun).

    torchrun ... fault.py MODE

Used by scripts/capture_diagnose_logs.py to capture the real logs under tests/diagnose_logs/ (CPU/gloo and GPU).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
timeout = datetime.timedelta(seconds=float(os.environ.get("FAULT_TIMEOUT_S", "10")))

if mode == "bad_device":  # device from the global RANK: node 1 has one GPU, cuda:1 does not exist there
    torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group("nccl", timeout=timeout)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
elif mode == "nccl_no_gpu":  # nccl where no GPU is visible
    dist.init_process_group("nccl", timeout=timeout)
    t = torch.ones(1)
    dist.all_reduce(t)
elif mode == "gloo_unsupported":  # an operation gloo does not implement (torch 2.13's gloo has all_to_all, but
    # not an AVG all_reduce of sparse tensors; older gloo raised "ProcessGroupGloo does not support alltoall")
    dist.init_process_group("gloo", timeout=timeout)
    dist.all_reduce(torch.ones(4).to_sparse(), op=dist.ReduceOp.AVG)
elif mode == "gloo_unsupported_caught":  # the demo that catches the error and exits 0 anyway
    import traceback
    dist.init_process_group("gloo", timeout=timeout)
    try:
        dist.all_reduce(torch.ones(4).to_sparse(), op=dist.ReduceOp.AVG)
    except Exception:
        traceback.print_exc()
        print(f"ERROR: sparse all_reduce failed on rank {rank}; continuing", flush=True)
    dist.destroy_process_group()
elif mode in ("timeout", "early_exit"):  # rank 1 never arrives at the second collective
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timeout)
    dev = "cuda" if backend == "nccl" else "cpu"
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    if backend == "nccl":
        torch.cuda.synchronize()
    print(f"rank {rank}: first all_reduce ok", flush=True)
    if rank == 1:
        if mode == "early_exit":
            print("rank 1: done, exiting", flush=True)
            sys.exit(0)
        time.sleep(600)
    dist.all_reduce(t)
    if backend == "nccl":
        torch.cuda.synchronize()
    print("second all_reduce ok", flush=True)
elif mode == "slurm_procid":  # rank from SLURM_PROCID, which is 0 for every process torchrun starts on a node
    r = int(os.environ.get("SLURM_PROCID", os.environ["RANK"]))
    dist.init_process_group("gloo", rank=r, world_size=world, timeout=timeout)
    t = torch.ones(1)
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
elif mode == "disk_full":  # a checkpoint larger than the filesystem
    dist.init_process_group("gloo", timeout=timeout)
    if rank == 0:
        torch.save(torch.zeros(4 * 1024 * 1024), os.path.join(os.environ["FAULT_DIR"], "checkpoint.pt"))
    dist.barrier()
elif mode == "sigkill":  # the kernel's OOM killer sends SIGKILL; here the rank receives the same signal
    dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), 9)
    dist.barrier()
elif mode == "iface":  # GLOO_SOCKET_IFNAME names an interface this host does not have
    dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
elif mode == "hang":  # rank 0 waits in all_reduce; rank 1 is busy elsewhere (a learner's "it just hangs")
    dist.init_process_group("gloo", timeout=timeout)
    t = torch.ones(1)
    print(f"rank {rank}: started", flush=True)
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
elif mode == "world_size4":  # world_size hard-coded for a 4-GPU box, run with 2 ranks
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timeout)
    dist.barrier()
elif mode == "shapes":  # every rank reduces a tensor of its own length
    dist.init_process_group("gloo", timeout=timeout)
    t = torch.ones(rank + 1)
    dist.all_reduce(t)
    print("sum", t.sum().item(), flush=True)
elif mode == "slow":  # rank 1 is only slow: it arrives after the others' timeout
    dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
    if rank == 1:
        time.sleep(float(os.environ.get("FAULT_SLOW_S", "8")))
    t = torch.ones(1)
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
elif mode == "cuda_on_cpu":  # the book's ch.3 start: a GPU picked before any CUDA check
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo", timeout=timeout)
elif mode in ("ddp_unused", "ddp_models"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Net(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.a = torch.nn.Linear(4, width)
            self.b = torch.nn.Linear(width, 1)
            self.unused = torch.nn.Linear(4, 4)  # never called in forward

        def forward(self, x):
            return self.b(self.a(x))

    dist.init_process_group("gloo", timeout=timeout)
    width = 8 + (rank if mode == "ddp_models" else 0)  # ddp_models: each rank builds a different model
    model = DDP(Net(width))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    print("trained", flush=True)
elif mode == "comment_text":  # a comment quoting an error message must not become the diagnosis
    dist.init_process_group("gloo", timeout=timeout)
    value = {"lr": 0.1}
    print(value["momentum"])  # on GPUs this used to fail with "invalid device ordinal"
elif mode == "tcp_localhost":  # the rendezvous address written into the script: every node looks at itself
    dist.init_process_group("gloo", init_method="tcp://localhost:29511", rank=rank, world_size=world,
                            timeout=timeout)
    dist.barrier()
elif mode == "master_env":  # MASTER_ADDR/PORT overwritten by the script: torchrun's values are lost
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
elif mode in ("silent_wrong", "no_set_epoch"):  # runs to the end, exit 0, and trains wrong
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo", timeout=timeout)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    if mode == "silent_wrong":  # no DistributedSampler: every rank trains on all 16 samples
        loader = DataLoader(data, batch_size=4, shuffle=True)
    else:  # a DistributedSampler, but set_epoch is never called: the same order every epoch
        loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
    model = torch.nn.Linear(4, 1)
    for epoch in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
    if mode == "silent_wrong" or rank == 0:  # silent_wrong: every rank saves to the same path
        torch.save(model.state_dict(), "checkpoint.pt")
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()
elif mode == "eval_rank0":  # evaluation on rank 0 only, through the DDP model (its forward broadcasts buffers)
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timeout)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    model(torch.randn(8, 4)).sum().backward()
    print(f"rank {rank}: trained", flush=True)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            print("eval", model(torch.randn(8, 4)).sum().item(), flush=True)
    else:
        time.sleep(600)  # rank 1 goes on with its own work
    dist.barrier()
elif mode == "busy":  # rank 1 computes for a while without printing (slow, not stuck), then joins
    dist.init_process_group("gloo", timeout=timeout)
    t = torch.ones(1)
    print(f"rank {rank}: started", flush=True)
    end = time.time() + float(os.environ.get("FAULT_BUSY_S", "20"))
    while rank == 1 and time.time() < end: sum(range(10000))  # noqa: E701 - one line: the same stack each sample
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
elif mode == "uneven":  # each rank gets its own share of 10 samples without a DistributedSampler: 6 and 4
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timeout)
    model = DDP(torch.nn.Linear(4, 1))
    mine = torch.randn(6 if rank == 0 else 4, 4)  # uneven: rank 0 has 3 batches of 2, rank 1 has 2
    print(f"rank {rank}: {len(mine) // 2} batches", flush=True)
    for x in mine.split(2):
        model(x).sum().backward()  # DDP all-reduces the gradients here: rank 0's third one has no partner
    dist.barrier()  # "wait for everyone before saving"
    print(f"rank {rank} done", flush=True)
elif mode == "ok":
    dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
    print(f"rank {rank} ok", flush=True)
    dist.destroy_process_group()
else:
    raise SystemExit(f"unknown mode {mode}")
