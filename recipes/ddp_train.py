"""A real DDP training job on real data that ships offline: the UCI handwritten digits (1797 8x8 images).

Runs unchanged under plain torchrun, e.g. two simulated nodes on one machine:

    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 ddp_train.py &
    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=1 --master_addr=127.0.0.1 --master_port=29500 ddp_train.py

What it shows (the point of the exercise):
  * one line per rank with RANK, LOCAL_RANK, WORLD_SIZE and the device: on two simulated single-GPU nodes every
    rank has LOCAL_RANK 0 and sees its one GPU as cuda:0; the device comes from LOCAL_RANK, never from RANK;
  * backend nccl on GPU, gloo on CPU;
  * an all-reduce check: every rank contributes rank+1, the sum must be WORLD_SIZE*(WORLD_SIZE+1)/2;
  * DistributedSampler: each rank trains on its own shard; loss falls; held-out accuracy at the end;
  * the checkpoint is written by global rank 0 only (RANK == 0, not LOCAL_RANK == 0: that would be every node).

Resuming after a preemption (recipe ``interruptible: true`` with ``checkpoint_dir: checkpoints`` and
``args: [..., "--resume-dir", "checkpoints"]``): broker copies that folder back from node 0 while the job runs and
puts the latest copy on the new node(s) before it relaunches this same command; the script does the rest in two
lines (every rank loads, global rank 0 saves every ``--save-every`` epochs to a temporary name, then renames):

    state = torch.load(ck, map_location=device) if ck.exists() else None            # resume when present
    torch.save(state, tmp); os.replace(tmp, ck)                                      # atomic save (rank 0)

Environment knobs: DDP_TIMEOUT_S (process-group timeout, default 300 s), DIGITS_CSV (data file path).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

HERE = Path(__file__).resolve().parent


def load_digits(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """64 pixel counts (0..16) and the label per row; returns X (N, 64) in [0, 1] and y (N,)."""
    with gzip.open(path, "rt") as f:
        rows = [list(map(int, r)) for r in csv.reader(f) if r]
    data = torch.tensor(rows, dtype=torch.float32)
    return data[:, :64] / 16.0, data[:, 64].long()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--checkpoint", default="checkpoint.pt")
    ap.add_argument("--crash-on-rank", type=int, default=None, help="raise on this global rank (failure drill)")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 when held-out accuracy is lower")
    ap.add_argument("--resume-dir", default=None,
                    help="folder of the resume checkpoint (the recipe's checkpoint_dir): loaded when present, "
                         "written every --save-every epochs")
    ap.add_argument("--save-every", type=int, default=1, help="epochs between resume checkpoints")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # LOCAL_RANK picks the GPU on this node, never RANK
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=float(os.environ.get("DDP_TIMEOUT_S", "300"))))
    assert dist.get_rank() == rank and dist.get_world_size() == world_size

    gpu = f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world_size} device={device} backend={backend} "
          f"host={socket.gethostname()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '-')}{gpu}",
          flush=True)

    # all-reduce check: sum of (rank + 1) over ranks
    x = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(x)
    expected = world_size * (world_size + 1) / 2
    ok = abs(x.item() - expected) < 1e-6
    print(f"RANK={rank} all_reduce_sum={x.item():g} expected={expected:g} {'ALLREDUCE_OK' if ok else 'ALLREDUCE_BAD'}",
          flush=True)
    if not ok:
        raise SystemExit(f"all-reduce gave {x.item()} instead of {expected}")

    X, y = load_digits(Path(os.environ.get("DIGITS_CSV", HERE / "data" / "digits.csv.gz")))
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(X), generator=g)
    n_test = len(X) // 5
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    train = TensorDataset(X[train_idx], y[train_idx])
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    t0 = time.time()
    first_loss = last_loss = None
    start_epoch = 0
    ck = Path(args.resume_dir, "resume.pt") if args.resume_dir else None
    state = torch.load(ck, map_location=device) if ck is not None and ck.exists() else None  # resume when present
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch, first_loss, last_loss = state["epoch"] + 1, state["first_loss"], state["last_loss"]
    if state is not None:
        print(f"RANK={rank} resumed_from_epoch={start_epoch}", flush=True)
    elif ck is not None:  # a first attempt: nothing was resumed
        print(f"RANK={rank} start_epoch=0 (no checkpoint to resume from yet)", flush=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        total, count = torch.zeros(2, device=device), 0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad()
            loss = loss_fn(ddp(xb), yb)
            loss.backward()
            opt.step()
            total[0] += loss.detach() * len(xb)
            total[1] += len(xb)
            count += 1
            if args.crash_on_rank == rank and epoch == 1:
                raise RuntimeError(f"deliberate crash on rank {rank} (--crash-on-rank)")
        dist.all_reduce(total)  # mean loss over every rank's shard
        epoch_loss = (total[0] / total[1]).item()
        first_loss = epoch_loss if first_loss is None else first_loss
        last_loss = epoch_loss
        if rank == 0:
            print(f"epoch={epoch} loss={epoch_loss:.4f} steps_per_rank={count}", flush=True)
        if ck is not None and rank == 0 and (epoch + 1) % max(1, args.save_every) == 0:
            ck.parent.mkdir(parents=True, exist_ok=True)
            tmp = ck.with_name(ck.name + ".tmp")  # broker never copies *.tmp: a half-written file is not taken
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "first_loss": first_loss, "last_loss": last_loss}, tmp)
            os.replace(tmp, ck)  # atomic: a reader sees the old or the new checkpoint

    model.eval()
    with torch.no_grad():
        pred = model(X[test_idx].to(device)).argmax(dim=1).cpu()
    accuracy = (pred == y[test_idx]).float().mean().item()
    # parameters must be identical on every rank after DDP training
    chk = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1).to(device)
    gathered = [torch.zeros_like(chk) for _ in range(world_size)]
    dist.all_gather(gathered, chk)
    in_sync = all(torch.allclose(t, gathered[0]) for t in gathered)
    print(f"RANK={rank} heldout_accuracy={accuracy:.4f} params_in_sync={in_sync} "
          f"train_s={time.time() - t0:.2f}", flush=True)

    if rank == 0:
        torch.save({"model": model.state_dict(), "accuracy": accuracy, "world_size": world_size,
                    "epochs": args.epochs}, args.checkpoint)
        print(f"checkpoint={os.path.abspath(args.checkpoint)} written by RANK=0", flush=True)
        print(f"loss {first_loss:.4f} -> {last_loss:.4f}; accuracy={accuracy:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    reasons = []
    if not in_sync:
        reasons.append("parameters differ between ranks after training (DDP did not keep them in sync)")
    if accuracy < args.min_accuracy:
        reasons.append(f"held-out accuracy {accuracy:.4f} is below --min-accuracy {args.min_accuracy:g}")
    if not (last_loss < first_loss):
        reasons.append(f"loss did not fall: first {first_loss:.4f}, last {last_loss:.4f} over {args.epochs} "
                       "epoch(s); run more epochs (--epochs 2 or more)")
    failed = bool(reasons)
    if rank == 0:
        for why in reasons:
            print(f"ERROR: {why}", file=sys.stderr, flush=True)
        if not failed:
            print("DDP_OK", flush=True)
    # os._exit after destroy_process_group avoids the gloo exit-time SIGABRT seen in ~1 of 10 CPU runs
    # (docs/design.md "Known pitfalls"); flush first because os._exit skips interpreter cleanup.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
