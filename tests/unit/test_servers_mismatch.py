"""``servers_mismatch``: a static PS list (``infer_config.servers``) is checked against what each
replica says it is, before a lookup could read IDs from replicas that do not own them."""

from __future__ import annotations

from persia.embedding_worker.service import servers_mismatch

ADDRESSES = ["ps-0:23333", "ps-1:23333", "ps-2:23333"]


def test_replicas_in_order_match():
    answers = [{"replica_index": i, "replica_size": 3} for i in range(3)]
    assert servers_mismatch(ADDRESSES, answers) is None


def test_a_swapped_pair_names_the_first_misplaced_entry():
    answers = [{"replica_index": i, "replica_size": 3} for i in (0, 2, 1)]
    why = servers_mismatch(ADDRESSES, answers)
    assert why is not None and why.startswith("infer_config.servers[1] = 'ps-1:23333' is PS replica 2 of 3")


def test_a_list_shorter_than_the_replica_set_is_refused():
    answers = [{"replica_index": i, "replica_size": 3} for i in range(2)]
    why = servers_mismatch(ADDRESSES[:2], answers)
    assert why is not None and "infer_config.servers[0]" in why and "position 0 of 2" in why


def test_a_replica_that_does_not_say_its_size_is_checked_by_index_alone():
    assert servers_mismatch(ADDRESSES[:2], [{"replica_index": 0}, {"replica_index": 1}]) is None
    assert servers_mismatch(ADDRESSES[:2], [{"replica_index": 1}, {"replica_index": 0}]) is not None
