"""the DDP tutorial's Trainer: self.gpu_id holds LOCAL_RANK, and the checkpoint is keyed on it."""
import os
import torch


class Trainer:
    def __init__(self, model):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model.to(self.gpu_id)  # ok: device-from-rank

    def _save_checkpoint(self, epoch):
        torch.save(self.model.state_dict(), "checkpoint.pt")

    def train(self, epochs):
        for epoch in range(epochs):
            if self.gpu_id == 0 and epoch % 10 == 0:
                self._save_checkpoint(epoch)  # expect: local-rank-writes
            if self.global_rank == 0:
                self._save_checkpoint(epoch)  # ok: local-rank-writes
