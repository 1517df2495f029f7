import shutil
import subprocess

import pytest

from spark_estimator.worker.comm.network import gloo_interface, interface_of


def ipv4_interfaces() -> list[tuple[str, str]]:
    """(interface, IPv4 address) pairs as ``ip`` lists them."""
    if shutil.which("ip") is None:
        pytest.skip("no ip command to list the interfaces")
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    return [(f[1], f[3].split("/")[0]) for f in (line.split() for line in out.stdout.splitlines())]


def test_interface_of_finds_the_interface_that_carries_an_address():
    assert interface_of("127.0.0.1") == "lo"
    for name, address in ipv4_interfaces():
        assert interface_of(address) == name
    assert interface_of("198.51.100.254") is None  # TEST-NET-2: on no interface here


def test_gloo_uses_the_interface_of_the_task_address_only_across_hosts(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    outside = [(n, a) for n, a in ipv4_interfaces() if not a.startswith("127.")]
    if outside:
        name, address = outside[0]
        assert gloo_interface(["198.51.100.254", address], 1) == {"GLOO_SOCKET_IFNAME": name}
        assert gloo_interface([address, address], 1) == {}  # one host: gloo finds it
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "chosen")
        assert gloo_interface(["198.51.100.254", address], 1) == {}  # the user's choice stays
        monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert gloo_interface(["198.51.100.254", "127.0.0.1"], 1) == {}  # loopback: left to gloo
    assert gloo_interface(["198.51.100.254", "198.51.100.253"], 1) == {}  # not here either
