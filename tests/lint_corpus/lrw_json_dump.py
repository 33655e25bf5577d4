"""open(.., "w") and json.dump to the open file under LOCAL_RANK 0."""
import json
import os

local_rank = int(os.environ["LOCAL_RANK"])
metrics = {"acc": 0.9}
if local_rank == 0:
    with open("metrics.json", "w") as f:  # expect: local-rank-writes
        json.dump(metrics, f)  # expect: local-rank-writes
    text = json.dumps(metrics)  # ok: local-rank-writes
