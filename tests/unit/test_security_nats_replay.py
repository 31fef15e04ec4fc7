"""Pure parts of the NATS data-path fixes: the replay window of a sender whose clock runs ahead,
keyed batch refs, and the cap on refs a release may name."""

from __future__ import annotations

import hashlib

import pytest
from persia import messages as M
from persia.security import SignatureChecker, Unauthorized, needs_signature, sign


def test_a_header_signed_ahead_of_the_receivers_clock_is_never_accepted_twice():
    """Signed at T+200 (the sender's clock runs ahead), checked at T: valid until T+500. Before, its
    nonce was kept until T+300 only: a fresh message at T+301 evicted it, and the same header was
    accepted again at T+302."""
    secret = b"k" * 32
    checker = SignatureChecker(secret)
    subj, payload = "persia.j.ps.clear.0", b"x"
    t = 10_000.0
    header = sign(secret, subj, payload, now=t + 200)
    checker.check(subj, payload, header, now=t)
    checker.check(subj, payload, sign(secret, subj, payload, now=t + 301), now=t + 301)
    with pytest.raises(Unauthorized, match="replayed"):
        checker.check(subj, payload, header, now=t + 302)
    with pytest.raises(Unauthorized, match="old"):  # and once it is forgotten, it is stale
        checker.check(subj, payload, header, now=t + 501)
    # nonces still go: memory is bounded by the window
    checker.check(subj, payload, sign(secret, subj, payload, now=t + 1200), now=t + 1200)
    assert len(checker._seen) == 1


def test_batch_refs_are_keyed_with_the_job_secret_and_unkeyed_without():
    from persia.security import batch_ref, ref_key

    unkeyed = int.from_bytes(hashlib.blake2b(b"s/0/7", digest_size=8).digest(), "big") >> 2
    assert ref_key(None) is None and ref_key(b"") is None
    assert batch_ref("s", 0, 7, None) == unkeyed  # no secret: as before
    keyed = batch_ref("s", 0, 7, ref_key(b"secret-a"))
    assert keyed != unkeyed and keyed != batch_ref("s", 0, 7, ref_key(b"secret-b"))
    assert keyed == batch_ref("s", 0, 7, ref_key(b"secret-a")) < 1 << 62
    assert ref_key(b"secret-a") != b"secret-a"


def test_release_and_nn_done_are_signed_and_a_release_is_capped():
    assert needs_signature("persia.job.ew.release.0")
    assert needs_signature("persia.job.nn.done")
    assert not needs_signature("persia.job.ew.forward.0")
    cap = getattr(M, "MAX_RELEASE_REFS", 1 << 20)
    M.validate(M.WorkerRelease, {"refs": list(range(cap))})
    assert cap <= 1 << 14
    with pytest.raises(M.MessageError, match="'refs'"):
        M.validate(M.WorkerRelease, {"refs": list(range(cap + 1))})
