"""The data loader role: PERSIA's batch types (``batch.py``), their wire form (``wire.py``) and
``DataCtx``, which sends each batch's ID features to an embedding worker and the rest, with the
worker's reference, to one NN rank (``ctx.py``)."""
