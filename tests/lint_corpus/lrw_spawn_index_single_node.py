"""mp.spawn's index is the global rank only on a single node: a rank-0 test on it is not judged either way."""
import torch
import torch.multiprocessing as mp


def run(rank, world_size):
    if rank == 0:
        torch.save({}, "ckpt.pt")  # ok: local-rank-writes
        print(f"world={world_size}")  # ok: local-rank-writes


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
