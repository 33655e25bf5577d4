"""a pandas to_csv keyed on LOCAL_RANK."""
import os
import pandas as pd

local_rank = int(os.environ.get("LOCAL_RANK", 0))
df = pd.DataFrame({"loss": [1.0, 0.5]})
if local_rank == 0:
    df.to_csv("metrics.csv")  # expect: local-rank-writes
