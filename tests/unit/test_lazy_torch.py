"""A data loader's imports and context do not load torch; PERSIA_TORCH_THREADS still holds for a
torch loaded later, and the NN worker's names are still in ``persia.ctx``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PERSIA_TORCH_THREADS")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=120)


def test_a_data_loader_starts_without_torch_and_a_later_torch_gets_its_threads():
    got = _run("""
        import sys
        from persia.ctx import BaseCtx, DataCtx, cnt_ctx
        from persia.embedding.data import PersiaBatch, IDTypeFeatureWithSingleID, NonIDTypeFeature, Label
        ctx = BaseCtx()
        assert "torch" not in sys.modules, "importing the data loader's API loaded torch"
        import torch
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        assert ctx.device == torch.device("cpu") and ctx.device is ctx.device
        print("ok")
    """, PERSIA_TORCH_THREADS="1", OMP_NUM_THREADS="2")
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]


def test_with_torch_loaded_first_the_context_sets_its_threads():
    got = _run("""
        import torch
        torch.set_num_threads(2)
        from persia.context import BaseCtx
        BaseCtx()
        print(torch.get_num_threads())
    """, PERSIA_TORCH_THREADS="1")
    assert got.returncode == 0 and got.stdout.strip() == "1", got.stderr[-2000:]


def test_a_context_inside_a_running_one_keeps_the_measured_count():
    """An eval_ctx between training steps made the count the start count again: the NN worker's
    measured choice (1 thread) held only until the first evaluation."""
    got = _run("""
        import torch
        from persia.context import BaseCtx
        with BaseCtx():
            start = torch.get_num_threads()
            torch.set_num_threads(1)  # what the NN worker's tuner chose
            with BaseCtx():  # an eval_ctx between training steps
                inner = torch.get_num_threads()
        BaseCtx()  # a context of its own, after training: the setting's start count again
        print(start, inner, torch.get_num_threads())
    """, PERSIA_TORCH_THREADS="auto:2")
    assert got.returncode == 0 and got.stdout.strip() == "2 1 2", (got.stdout, got.stderr[-2000:])


def test_a_bad_thread_count_is_refused_by_name():
    got = _run("from persia.context import BaseCtx; BaseCtx()", PERSIA_TORCH_THREADS="0")
    assert got.returncode != 0 and "PERSIA_TORCH_THREADS must be >= 1, got '0'" in got.stderr


def test_every_name_persia_ctx_exports_resolves():
    import persia.ctx as ctx
    from persia.nn_worker.train_ctx import TrainCtx

    for name in ctx.__all__:
        assert getattr(ctx, name) is not None
    assert ctx.TrainCtx is TrainCtx and "TrainCtx" in dir(ctx)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ctx.Nope  # noqa: B018


def test_torch_threads_setting_parses_a_count_or_auto():
    from persia.context import torch_threads_setting
    from persia.errors import PersiaValidationError

    assert torch_threads_setting("3", cores=2, local_procs=1) == (3, False)
    assert torch_threads_setting("auto", cores=2, local_procs=1) == (2, True)
    assert torch_threads_setting(" Auto ", cores=16, local_procs=4) == (4, True)
    assert torch_threads_setting("auto", cores=2, local_procs=4) == (1, True)
    assert torch_threads_setting("auto:3", cores=2, local_procs=1) == (3, True)
    for bad, msg in (("two", "a count, 'auto' or 'auto:<count>', got 'two'"), ("auto:x", "got 'auto:x'"),
                     ("auto:0", ">= 1, got 'auto:0'"), ("-1", ">= 1, got '-1'")):
        with pytest.raises(PersiaValidationError, match=msg):
            torch_threads_setting(bad, cores=2, local_procs=1)


def test_auto_threads_start_at_this_process_share():
    got = _run("""
        import torch
        from persia.context import BaseCtx
        ctx = BaseCtx()
        print(torch.get_num_threads(), ctx.tune_torch_threads)
    """, PERSIA_TORCH_THREADS="auto", LOCAL_WORLD_SIZE="1")
    import os
    assert got.returncode == 0 and got.stdout.split() == [str(len(os.sched_getaffinity(0))), "True"], got.stderr[-2000:]


def test_the_launcher_and_the_embedding_roles_start_without_torch():
    """Every role's process builds the launcher's whole parser, ``serve`` included; the serving
    package's server imports torch. Through it the PS, embedding worker and data loader each spent
    about 2 s of CPU on torch they never use, 4 processes at once on a job's start."""
    got = _run("""
        import sys
        from persia.launcher import build_parser
        build_parser().parse_args(["embedding-parameter-server", "--port", "0"])
        import persia.embedding_ps.service, persia.embedding_worker.service, persia.local, persia.serving
        loaded = "torch" in sys.modules
        from persia.serving import ServeConfig  # the package's names still resolve, on first use
        print(loaded, ServeConfig.__name__)
    """)
    assert got.returncode == 0 and got.stdout.split() == ["False", "ServeConfig"], got.stderr[-2000:]
