"""the refusal in the __main__ block runs before main() calls init_process_group."""
import sys
import torch
import torch.distributed as dist


def main():
    dist.init_process_group(backend="nccl")  # ok: nccl-no-fallback


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("GPU nodes only")
    main()
