"""mp.spawn: the spawned index is local; node * gpus + index is the global rank."""
import argparse

import torch
import torch.multiprocessing as mp


def train(gpu, args):
    rank = args.nr * args.gpus + gpu
    torch.cuda.set_device(gpu)  # ok: device-from-rank
    model = torch.nn.Linear(2, 2).cuda(rank)  # expect: device-from-rank
    return model


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    args = ap.parse_args()
    mp.spawn(train, nprocs=args.gpus, args=(args,))
