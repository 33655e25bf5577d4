"""every rank downloads (or finds the files): correct."""
from torchvision import datasets

train = datasets.MNIST("data", train=True, download=True)  # ok: download-global-rank-0
