"""SLURM_PROCID with RANK as its default: Slurm's value wins."""
import os

rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))  # expect: slurm-env-under-torchrun
