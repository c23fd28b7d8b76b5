"""The pure parts of the multi-host checks (the real runs are in test_multihost.py)."""
import socket

from trainbridge.launch.environment import LaunchEnv
from trainbridge.launch.host_checks import check_interfaces, check_master_addr, check_rendezvous_endpoint
from trainbridge.launch.network import is_loopback, source_address_towards
from trainbridge.launch.rendezvous import choose_gloo_interface, connect_failure, own_address


def test_interfaces_that_differ_are_one_line_naming_each_host():
    assert check_interfaces({"a": "eth0", "b": "eth0", "c": None}) == []
    [line] = check_interfaces({"a": "eth0", "b": "ens5"})
    assert "(a: eth0, b: ens5)" in line and "--network-interface" in line


def test_an_endpoint_that_is_no_host_is_named_with_the_fix():
    own = socket.gethostname()
    assert check_rendezvous_endpoint(f"{own}:29400", [own, "elsewhere"]) == []
    [line] = check_rendezvous_endpoint("192.0.2.200:29400", [own])
    assert "192.0.2.200:29400 is none of the hosts" in line and "--rdzv-conf is_host=1" in line


def test_a_loopback_master_addr_for_several_hosts_is_a_problem():
    [line] = check_master_addr("127.0.0.1", None, ["a", "b"])
    assert "MASTER_ADDR 127.0.0.1 is loopback" in line
    assert check_master_addr("127.0.0.1", None, ["a"]) == []


def test_one_host_jobs_keep_loopback_and_gloo_untouched():
    env = LaunchEnv(launcher="mpirun", rank=0, world_size=2, local_size=2)
    assert own_address(env, {}) == "127.0.0.1"
    environ = {}
    choose_gloo_interface(env, "127.0.0.1", environ)
    assert environ == {}
    environ = {"GLOO_SOCKET_IFNAME": "mine"}  # the user's choice is kept, also across hosts
    choose_gloo_interface(LaunchEnv(launcher="torchrun", rank=1, world_size=2, local_size=1), "192.0.2.1", environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "mine"}


def test_a_failed_gloo_connection_names_the_fix():
    env = LaunchEnv(launcher="torchrun", rank=0, world_size=2, local_size=1)
    line = connect_failure(env, "gloo", RuntimeError("Gloo connectFullMesh failed with ... remote=[127.0.0.1]:1\nmore"))
    assert "\n" not in line and "advertised a loopback address" in line and "GLOO_SOCKET_IFNAME" in line


def test_route_lookup_sends_nothing_and_knows_loopback():
    assert is_loopback("127.0.1.1") and is_loopback("::1") and not is_loopback("10.77.0.1")
    assert is_loopback(source_address_towards("127.0.0.1"))
