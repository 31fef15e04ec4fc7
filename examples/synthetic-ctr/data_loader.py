"""PERSIA data loader: streams this replica's share of the training split, one pass.

Settings come from the environment (see synthetic_ctr/settings.py); ``REPLICA_INDEX`` /
``REPLICA_SIZE`` shard the batches between data loaders. Leaving ``DataCtx`` ends the stream.
"""

from persia.ctx import DataCtx
from persia.env import get_replica_index, get_replica_size

from batches import to_persia_batch
from synthetic_ctr.reader import read_chunks
from synthetic_ctr.settings import ExampleSettings

if __name__ == "__main__":
    settings = ExampleSettings.from_env()
    with DataCtx() as ctx:
        for batch in read_chunks(
            settings.data_dir,
            settings.batch_size,
            "train",
            max_rows=settings.train_rows,
            replica_index=get_replica_index(),
            replica_size=get_replica_size(),
        ):
            ctx.send_data(to_persia_batch(batch, requires_grad=True))
