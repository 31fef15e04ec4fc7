"""Data loader of the metrics test's tiny job."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import make_batch  # noqa: E402

from persia.ctx import DataCtx  # noqa: E402

with DataCtx() as ctx:
    for i in range(int(os.environ.get("TINY_BATCHES", "20"))):
        ctx.send_data(make_batch(i))
