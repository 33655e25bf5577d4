"""reading a file under LOCAL_RANK 0 is not a write."""
import os

local_rank = int(os.environ["LOCAL_RANK"])
if local_rank == 0:
    with open("data.csv") as f:  # ok: local-rank-writes
        rows = f.read()
