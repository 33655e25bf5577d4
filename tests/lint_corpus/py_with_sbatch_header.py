#!/usr/bin/env python3
#SBATCH --nodes=2
#SBATCH --gpus-per-node=1
"""sbatch runs Python scripts too: #SBATCH lines in a .py file do not make it a shell script."""
import os
import torch

torch.cuda.set_device(int(os.environ["RANK"]))  # expect: device-from-rank
