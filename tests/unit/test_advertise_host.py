"""Which address a role advertises to the others (``choose_advertise_host``), and
``PERSIA_SOCKET_IFNAME``, PERSIA's way to name the interface: without it a host whose name maps to
loopback advertised 127.0.0.1, and peers on other hosts connected to themselves."""

from __future__ import annotations

import pytest

from persia.utils import choose_advertise_host, interface_ipv4


def _choose(env, bound="0.0.0.0", interfaces=None, hostname="10.0.0.5", route="10.0.0.9"):
    interfaces = {"eth0": "10.0.0.7"} if interfaces is None else interfaces
    return choose_advertise_host(env, bound, interfaces.get, lambda: hostname, lambda: route)


def test_an_explicit_advertise_host_and_then_a_one_address_bind_win():
    assert _choose({"PERSIA_ADVERTISE_HOST": "ps-0.svc", "PERSIA_SOCKET_IFNAME": "eth0"}, "10.1.1.1") == "ps-0.svc"
    assert _choose({"PERSIA_SOCKET_IFNAME": "eth0"}, bound="10.1.1.1") == "10.1.1.1"  # where it listens


def test_socket_ifname_names_the_interface_whose_address_is_advertised():
    assert _choose({"PERSIA_SOCKET_IFNAME": "eth0"}) == "10.0.0.7"


def test_an_interface_without_an_address_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"PERSIA_SOCKET_IFNAME='eth9': no such interface with an IPv4 address "
                                         r"\(interfaces here: .*lo"):
        _choose({"PERSIA_SOCKET_IFNAME": "eth9"})


def test_a_hostname_on_loopback_gives_way_to_the_default_routes_address():
    assert _choose({}) == "10.0.0.5"
    assert _choose({}, hostname="127.0.1.1") == "10.0.0.9"
    assert _choose({}, hostname=None) == "10.0.0.9"
    assert _choose({}, hostname="127.0.1.1", route=None) == "127.0.0.1"  # a host with no network at all


def test_the_loopback_interfaces_address_is_read_from_the_kernel():
    assert interface_ipv4("lo") == "127.0.0.1"
    assert interface_ipv4("no-such-if0") is None
