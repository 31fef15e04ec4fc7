"""Embedding workers as they answered ``ew.info`` before it listed the slot names: a data loader
then leaves the slot check to the worker, which refuses a batch with an unknown slot itself
(the path the worker-refusal tests exercise)."""

from __future__ import annotations

from persia.bus import NatsBus, subject


def without_slot_list(monkeypatch) -> None:
    """Every ``ew.info`` answer this test's data loaders read lacks ``slots``."""
    request_retry = NatsBus.request_retry
    info = subject("ew", "info")

    def old_answer(self, subj, obj=None, **retry):
        reply = request_retry(self, subj, obj, **retry)
        if subj == info and isinstance(reply, dict):
            reply = {k: v for k, v in reply.items() if k != "slots"}
        return reply

    monkeypatch.setattr(NatsBus, "request_retry", old_answer)
