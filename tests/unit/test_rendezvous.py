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


def test_a_lease_the_table_forgot_is_taken_back_at_its_index():
    """The table lives in PS replica 0: restarted, it forgets every lease; renewing with the index
    held takes it back, where the renewal used to be refused and the member ran on regardless."""
    a = Assignments(ttl_s=10)
    assert a.renew("pod-b", now=0, index=1)
    assert a.claim("pod-c", 2, now=1) == 0  # index 1 is pod-b's again: a newcomer does not get it
    assert not a.renew("pod-a", now=2)  # no index: nothing to take back


def test_a_lease_another_member_took_is_not_taken_back():
    a = Assignments(ttl_s=10)
    a.claim("pod-a", 2, now=0)
    assert a.claim("pod-c", 2, now=11) == 0  # pod-a's lease ran out, pod-c took index 0
    assert not a.renew("pod-a", now=12, index=0)
    assert a.leases["pod-c"][0] == 0 and "pod-a" not in a.leases


def test_a_released_index_is_free_at_once_and_only_its_holder_releases_it():
    t = Assignments(ttl_s=30.0)
    assert t.claim("a", 2, now=0.0) == 0 and t.claim("b", 2, now=0.0) == 1
    assert not t.release("b", 0)  # not b's: nothing changes
    assert t.release("a", 0)
    assert t.claim("c", 2, now=1.0) == 0  # long before a's lease would have expired
    assert not t.release("a", 0)  # a late release of a lease since taken by c
    assert t.leases["c"][0] == 0
