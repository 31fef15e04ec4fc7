from persia.rendezvous import Assignments


def test_claims_get_distinct_indices_and_keep_them():
    a = Assignments(ttl_s=10)
    assert a.claim("pod-a", 2, now=0) == 0
    assert a.claim("pod-b", 2, now=1) == 1
    assert a.claim("pod-c", 2, now=2) is None  # full: the claimant retries
    assert a.claim("pod-a", 2, now=3) == 0  # a restart of the same pod keeps its index


def test_a_vanished_member_frees_its_index_after_the_ttl():
    a = Assignments(ttl_s=10)
    a.claim("pod-a", 2, now=0)
    a.claim("pod-b", 2, now=0)
    assert a.renew("pod-b", now=8)
    assert a.claim("pod-c", 2, now=11) == 0  # pod-a did not renew
    assert not a.renew("pod-a", now=12)
    assert a.claim("pod-c", 2, now=12) == 0


def test_scale_down_drops_indices_past_the_new_size():
    a = Assignments(ttl_s=10)
    a.claim("pod-a", 3, now=0)
    a.claim("pod-b", 3, now=0)
    a.claim("pod-c", 3, now=0)
    assert a.claim("pod-c", 2, now=1) is None  # index 2 no longer exists and 0, 1 are held
