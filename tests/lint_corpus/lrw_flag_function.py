"""a helper of the file answers "am I the main process?" from LOCAL_RANK."""
import os
import torch


def is_main():
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def is_global_main():
    return int(os.environ.get("RANK", "0")) == 0


if is_main():
    torch.save({}, "ckpt.pt")  # expect: local-rank-writes
if is_global_main():
    torch.save({}, "final.pt")  # ok: local-rank-writes
