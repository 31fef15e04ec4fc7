"""A data-loader process for tests: ``python -m tests.integration.loader_process FIRST COUNT [HOLD]``
sends batches ``make_batch(FIRST .. FIRST+COUNT-1)`` in one ``DataCtx`` and ends its stream.

With ``HOLD`` (a batch id of this process), that batch's ID leg never leaves: its request (with
the batches grouped with it, ``PERSIA_DATA_GROUP``) waits forever while the dense leg goes to the
NN rank as usual, so a test can kill the process between the two legs of a batch. The process
prints ``holding <id>`` when it gets there."""

from __future__ import annotations

import asyncio
import sys

from persia.bus import NatsBus
from persia.ctx import DataCtx
from persia.data_loader.stream import end_of_stream
from tests.integration.test_training_path import make_batch


def main(first: int, count: int, hold: int | None) -> None:
    if hold is not None:
        send = NatsBus.arequest_retry

        async def held(self, subj, obj=None, **kwargs):
            batches = obj.get("batches", [obj]) if isinstance(obj, dict) else []
            if ".ew.forward" in subj and any(b.get("batch_id") == hold for b in batches):
                print(f"holding {hold}", flush=True)
                await asyncio.Event().wait()  # never set: the ID leg stays between here and there
            return await send(self, subj, obj, **kwargs)

        NatsBus.arequest_retry = held
    with DataCtx() as ctx:
        for seed in range(first, first + count):
            ctx.send_data(make_batch(seed))
    end_of_stream()
    print("stream ended", flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(args[0], args[1], args[2] if len(args) > 2 else None)
