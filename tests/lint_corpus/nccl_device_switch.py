"""the backend follows the user's device switch: gloo is there for --device cpu."""
import argparse
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
args = ap.parse_args()
backend = "nccl" if args.device == "cuda" else "gloo"
dist.init_process_group(backend=backend)  # ok: nccl-no-fallback
