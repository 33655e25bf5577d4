"""a class whose __init__ gets LOCAL_RANK at its only construction: `rank` there is local."""
import os
import torch


class Trainer:
    def __init__(self, model, rank):
        self.model = model.to(rank)  # ok: device-from-rank


trainer = Trainer(torch.nn.Linear(2, 2), int(os.environ["LOCAL_RANK"]))
