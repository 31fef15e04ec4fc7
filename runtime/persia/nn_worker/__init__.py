"""The NN worker role: its contexts (``embedding_ctx.py``: lookups and tensors, ``train_ctx.py``:
hybrid training, ``infer_ctx.py``: serving, ``checkpoint.py``), the datasets and the DataLoader
that looks embeddings up ahead of training (``datasets.py``, ``loader.py``, ``lookahead.py``,
``reorder.py``), DDP options (``distributed.py``), denormal floats flushed to zero while a context
trains (``denormals.py``), and what the NN worker sends the PS at start
(``embedding_config.py``, ``optim.py``)."""
