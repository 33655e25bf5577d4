#!/bin/bash
#SBATCH --job-name=train_ddp
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err

# Chapter 8, "Your first multi-node job": two nodes, one GPU each.
module load cuda 2>/dev/null || true

export MASTER_ADDR=localhost
export MASTER_PORT=29500
export RANK=$SLURM_PROCID

echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"
torchrun --nnodes=2 --nproc_per_node=1 --node_rank=$SLURM_NODEID \
    --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT \
    train.py --epochs 3
