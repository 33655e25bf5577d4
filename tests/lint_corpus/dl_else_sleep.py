"""Global rank 0 downloads, the others sleep: the other hosts never get the data."""
import os
import time
import urllib.request

rank = int(os.environ["RANK"])
if rank == 0:
    urllib.request.urlretrieve("https://example.invalid/data.tar", "data.tar")  # expect: download-global-rank-0
else:
    time.sleep(30)
