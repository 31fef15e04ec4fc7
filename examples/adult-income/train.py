"""Adult-income NN worker: hybrid training, then test AUC (PERSIA's example).

``EPOCHS=N`` trains N epochs and evaluates after each (one ``StreamingDataset(until="epoch")`` per
epoch)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.metrics import roc_auc_score  # noqa: E402

from adult import ID_SLOTS, batches, read_split  # noqa: E402
from model import DNN  # noqa: E402
from persia.ctx import TrainCtx, eval_ctx  # noqa: E402
from persia.data import DataLoader, IterableDataset, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_local_rank, get_rank, get_world_size  # noqa: E402
from persia.logger import get_default_logger  # noqa: E402
from persia.utils import report_result, setup_seed  # noqa: E402

logger = get_default_logger("nn_worker")

CPU = not torch.cuda.is_available()
DEVICE_ID = None if CPU else get_local_rank()
REPRODUCIBLE = bool(int(os.environ.get("REPRODUCIBLE", 0)))
EMBEDDING_STALENESS = int(os.environ.get("EMBEDDING_STALENESS", 10))
CKPT_DIR = os.environ.get("PERSIA_CKPT_DIR")
LOAD_CKPT_DIR = os.environ.get("PERSIA_LOAD_CKPT_DIR")
EPOCHS = int(os.environ.get("EPOCHS", 1))


class TestDataset(IterableDataset):
    def __init__(self, batch_size: int = 128):
        super().__init__(buffer_size=10)
        self.split = read_split("test")
        self.batch_size = batch_size

    def __iter__(self):
        yield from batches(self.split, self.batch_size, requires_grad=False)


def test(model: torch.nn.Module) -> dict:
    model.eval()
    preds, labels = [], []
    with eval_ctx(model=model) as ctx, torch.no_grad():
        for batch in DataLoader(TestDataset()):
            output, label = ctx.forward(batch)
            preds.append(output.cpu().numpy().ravel())
            labels.append(label[0].cpu().numpy().ravel())
    model.train()
    y, p = np.concatenate(labels), np.concatenate(preds)
    return {"auc": float(roc_auc_score(y, p)), "accuracy": float(((p > 0.5) == y).mean()), "test_samples": int(y.size)}


if __name__ == "__main__":
    setup_seed(3)
    model = DNN(num_slots=len(ID_SLOTS))
    dense_optimizer = torch.optim.SGD(model.parameters(), lr=float(os.environ.get("DENSE_LR", 0.1)))
    embedding_optimizer = Adagrad(lr=float(os.environ.get("EMBEDDING_LR", 1e-2)))
    loss_fn = torch.nn.BCELoss()
    with TrainCtx(
        model=model,
        embedding_optimizer=embedding_optimizer,
        dense_optimizer=dense_optimizer,
        mixed_precision=not CPU,
        device_id=DEVICE_ID,
    ) as ctx:
        if LOAD_CKPT_DIR:
            ctx.load_checkpoint(LOAD_CKPT_DIR)
        start, samples, steps = time.monotonic(), 0, 0
        epoch_aucs = []
        for epoch in range(EPOCHS):
            # one epoch per StreamingDataset, so the model is evaluated between epochs
            stream = StreamingDataset(10, until="epoch" if EPOCHS > 1 else "stream")
            loader = DataLoader(stream, reproducible=REPRODUCIBLE, embedding_staleness=EMBEDDING_STALENESS)
            batch_idx = -1
            for batch_idx, data in enumerate(loader):
                output, labels = ctx.forward(data)
                loss = loss_fn(output, labels[0])
                ctx.backward(loss)
                samples += labels[0].shape[0]
                steps += 1
                if batch_idx % 50 == 0:
                    logger.info("batch %d loss %.4f", batch_idx, loss.item())
            ctx.wait_for_pending_updates()
            # after a restart, the epochs trained before it stream nothing: no AUC of theirs to report
            if EPOCHS > 1 and batch_idx >= 0:
                epoch_aucs.append(round(test(model)["auc"], 6))
                logger.info("epoch %d: test AUC %.4f", epoch, epoch_aucs[-1])
        elapsed = time.monotonic() - start
        result = test(model)
        if epoch_aucs:
            result["epoch_aucs"] = epoch_aucs
        # after a restart (PERSIA_CHECKPOINT_DIR set) training resumed at ctx.start_step
        result.update(train_samples=samples, train_steps=steps, start_step=ctx.start_step,
                      samples_per_sec=samples / max(elapsed, 1e-9), rank=get_rank() or 0,
                      world_size=get_world_size() or 1)
        logger.info("test AUC %.4f accuracy %.4f", result["auc"], result["accuracy"])
        if CKPT_DIR and (get_rank() or 0) == 0:
            ctx.dump_checkpoint(CKPT_DIR, with_jit_model=True)
        if (get_rank() or 0) == 0:
            report_result(**result)
