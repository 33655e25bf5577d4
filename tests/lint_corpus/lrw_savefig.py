"""savefig under `not local_rank`."""
import os
import matplotlib.pyplot as plt

local_rank = int(os.environ["LOCAL_RANK"])
plt.plot([1, 2, 3])
if not local_rank:
    plt.savefig("loss.png")  # expect: local-rank-writes
