"""RANK with SLURM_PROCID as its default: torchrun's value wins."""
import os

rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))  # ok: slurm-env-under-torchrun
