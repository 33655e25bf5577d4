"""`if rank != 0: sleep` then the download in the else."""
import os
import time
from urllib.request import urlretrieve

rank = int(os.environ["RANK"])
if rank != 0:
    time.sleep(60)
else:
    urlretrieve("https://example.invalid/w.bin", "w.bin")  # expect: download-global-rank-0
