"""Online data loader of the tiny job: never ends; one batch every ONLINE_BATCH_INTERVAL seconds
(data arriving over time), each a fresh random batch of the same ID ranges."""

import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_data import make_batch  # noqa: E402

from persia.ctx import DataCtx  # noqa: E402
from persia.env import get_replica_index  # noqa: E402

interval = float(os.environ.get("ONLINE_BATCH_INTERVAL", "0.01"))
offset = 1_000_000 * (get_replica_index() or 0)
with DataCtx() as ctx:
    for i in itertools.count():
        ctx.send_data(make_batch(offset + i))
        time.sleep(interval)
