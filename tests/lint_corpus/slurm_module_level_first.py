"""a module-level SLURM_PROCID read runs before main() reads RANK."""
import os

RANK_FROM_SLURM = int(os.environ.get("SLURM_PROCID", "0"))  # expect: slurm-env-under-torchrun


def main():
    rank = int(os.environ.get("RANK", RANK_FROM_SLURM))
    return rank
