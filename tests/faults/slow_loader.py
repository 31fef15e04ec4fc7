"""The adult-income data loader, paced (``SLOW_S`` seconds a batch) so a fault lands mid-training."""

import os
import runpy
import time
from pathlib import Path

import persia.ctx

_send = persia.ctx.DataCtx.send_data
_pause = float(os.environ.get("SLOW_S", "0.03"))


def _paced(self, batch, *args, **kwargs):
    time.sleep(_pause)
    return _send(self, batch, *args, **kwargs)


persia.ctx.DataCtx.send_data = _paced
runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "adult-income" / "data_loader.py"),
               run_name="__main__")
