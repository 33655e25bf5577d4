"""SLURM_PROCID/SLURM_NTASKS preferred over RANK/WORLD_SIZE: wrong under srun .. torchrun."""
import os

if "SLURM_PROCID" in os.environ:  # expect: slurm-env-under-torchrun
    rank = int(os.environ["SLURM_PROCID"])  # expect: slurm-env-under-torchrun
    world = int(os.environ["SLURM_NTASKS"])  # expect: slurm-env-under-torchrun
else:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
