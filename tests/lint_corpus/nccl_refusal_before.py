"""a GPU-only script that refuses to start without CUDA documents it: not a finding."""
import sys
import torch
import torch.distributed as dist


def main():
    if not torch.cuda.is_available():
        sys.exit("this job needs GPUs")
    dist.init_process_group("nccl")  # ok: nccl-no-fallback


main()
