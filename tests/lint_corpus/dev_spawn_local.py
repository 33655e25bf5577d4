"""mp.spawn passes the local process index as the first argument: a fine device index."""
import torch
import torch.multiprocessing as mp


def main(rank, world_size):
    torch.cuda.set_device(rank)  # ok: device-from-rank
    print(world_size)


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
