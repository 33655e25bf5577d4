"""a method guarded on self.local_rank calls a helper method that saves."""
import os
import torch


class Trainer:
    def __init__(self):
        self.local_rank = int(os.environ["LOCAL_RANK"])

    def _save(self, epoch):
        torch.save({"epoch": epoch}, "snapshot.pt")

    def train(self, epochs):
        for epoch in range(epochs):
            if self.local_rank == 0 and epoch % 10 == 0:
                self._save(epoch)  # expect: local-rank-writes
