"""The rendezvous member name (persia.rendezvous.member_name): one per live process of a machine."""

from persia.rendezvous import Assignments, member_name


def test_processes_of_one_host_are_distinct_members_and_get_distinct_indices():
    """By host name alone, the second process of a machine was answered the first one's index."""
    a, b = member_name("vm", 101), member_name("vm", 102)
    assert a != b
    table = Assignments()
    assert sorted([table.claim(a, 2, 0.0), table.claim(b, 2, 0.0)]) == [0, 1]


def test_a_container_restarted_at_the_same_pid_is_the_same_member():
    assert member_name("pod-x", 1) == member_name("pod-x", 1)
    table = Assignments()
    index = table.claim(member_name("pod-x", 1), 2, 0.0)
    assert table.claim(member_name("pod-x", 1), 2, 1.0) == index


def test_a_hostname_given_to_the_process_is_its_member_name(monkeypatch):
    import socket

    monkeypatch.setenv("HOSTNAME", "nn-abc")
    assert member_name() == "nn-abc"
    monkeypatch.setenv("HOSTNAME", socket.gethostname())  # the machine's own: shared by its processes
    assert member_name() != socket.gethostname() and member_name().startswith(socket.gethostname() + "/")
