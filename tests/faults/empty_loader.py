"""A data loader whose dataset yields nothing (an empty file, a filter that drops every row)."""

from persia.ctx import DataCtx

with DataCtx() as ctx:
    pass
