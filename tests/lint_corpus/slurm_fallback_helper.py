"""a helper that reads SLURM_PROCID, called only when RANK is absent: torchrun's variables win."""
import os


def from_slurm():
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])  # ok: slurm-env-under-torchrun


def main():
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return from_slurm()
