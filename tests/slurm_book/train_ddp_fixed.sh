#!/bin/bash
#SBATCH --job-name=train_ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:10:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err

# Chapter 8's job, fixed for CPU nodes: no GPU request (gloo), one torchrun per node started by srun, and the
# master address taken from the allocation instead of localhost.
set -euo pipefail

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 10000))

echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, master $MASTER_ADDR:$MASTER_PORT"
srun --label --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes=$SLURM_NNODES --nproc_per_node=1 \
    --node_rank=$SLURM_NODEID --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \
    train.py "$@"' train "$@"
