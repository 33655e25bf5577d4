"""torchrun's variables first, Slurm's only as a fallback: fine."""
import os

if "RANK" in os.environ:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
elif "SLURM_PROCID" in os.environ:  # ok: slurm-env-under-torchrun
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])  # ok: slurm-env-under-torchrun
