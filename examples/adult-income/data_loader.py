"""Adult-income data loader: streams the training set to the embedding and NN workers.

``EPOCHS=N`` streams it N times, one ``DataCtx`` per epoch (leaving a DataCtx ends an epoch; the
stream ends when this process does)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from adult import batches, read_split  # noqa: E402
from persia.ctx import DataCtx  # noqa: E402
from persia.env import get_replica_index, get_replica_size  # noqa: E402

BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 128))
EPOCHS = int(os.environ.get("EPOCHS", 1))

if __name__ == "__main__":
    train = read_split("train")
    for _epoch in range(EPOCHS):
        with DataCtx() as ctx:
            for batch in batches(train, BATCH_SIZE, requires_grad=True,
                                 replica_index=get_replica_index(), replica_size=get_replica_size()):
                ctx.send_data(batch)
