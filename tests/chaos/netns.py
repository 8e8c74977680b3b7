"""Network partitions for the chaos tests: one Linux network namespace per storage node.

``tc netem`` and iptables are not available on the machines this runs on, but network
namespaces and veth pairs are (as root). So each storage node runs in a namespace of its
own, joined to a bridge in the root namespace by a veth pair::

    root namespace: bridge tl<tag>br 10.77.<k>.1/24   <- etcd, controllers, gateway, tests
      veth tl<tag>h<i>  <->  eth0 in namespace tl<tag>n<i>: 10.77.<k>.<10+i>/24  <- broker i

``isolate(host)`` takes the root end of the node's veth down: every packet to and from
that node is dropped, in both directions — the node can reach neither its peers, nor the
controllers, nor etcd (so its registration lease expires), and nobody reaches it. Open TCP
connections are not reset; they stall, as across a real partition, until keepalives or
deadlines give up. ``heal(host)`` brings the link back.

Names carry a random tag so concurrent runs (and leftovers of a killed run) never clash;
``close()`` deletes the namespaces and the bridge (the veths go with their namespaces).
Every change is made with ``ip`` from iproute2; nothing here needs a daemon.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass

SUBNET_PREFIX = "10.77"
FIRST_HOST_OCTET = 10
MAX_HOSTS = 200


class NetworkUnavailableError(RuntimeError):
    """This machine (or user) cannot create network namespaces."""


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkUnavailableError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def namespaces_available() -> str | None:
    """None if namespaces can be used here, else why not (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"tlprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (NetworkUnavailableError, FileNotFoundError) as exc:
        return str(exc)
    _ip("netns", "del", probe)
    return None


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace on the bridge."""

    name: str
    netns: str
    address: str  # the namespace's IPv4 address
    veth_root: str  # the root-namespace end: down = isolated

    @property
    def command_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the namespace (same PID)."""
        return ["ip", "netns", "exec", self.netns]


class Network:
    """A bridge and namespaces; see the module docstring. Not thread-safe."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        # A /24 per run, from the tag, so two runs at once use different subnets.
        self._subnet = f"{SUBNET_PREFIX}.{int(self.tag, 16) % 250 + 1}"
        self.bridge = f"tl{self.tag}br"
        self.gateway_address = f"{self._subnet}.1"
        self.hosts: dict[str, Host] = {}
        self.isolated: set[str] = set()
        _ip("link", "add", self.bridge, "type", "bridge")
        try:
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except NetworkUnavailableError:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        index = len(self.hosts)
        if index >= MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts")
        netns = f"tl{self.tag}n{index}"
        veth_root, veth_inner = f"tl{self.tag}h{index}", f"tl{self.tag}i{index}"
        address = f"{self._subnet}.{FIRST_HOST_OCTET + index}"
        _ip("netns", "add", netns)
        host = Host(name, netns, address, veth_root)
        self.hosts[name] = host
        _ip("link", "add", veth_root, "type", "veth", "peer", "name", veth_inner)
        _ip("link", "set", veth_inner, "netns", netns)
        _ip("link", "set", veth_root, "master", self.bridge)
        _ip("link", "set", veth_root, "up")
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{address}/24", "dev", veth_inner, netns=netns)
        _ip("link", "set", veth_inner, "up", netns=netns)
        return host

    def isolate(self, name: str) -> None:
        host = self.hosts[name]
        _ip("link", "set", host.veth_root, "down")
        self.isolated.add(name)

    def heal(self, name: str) -> None:
        host = self.hosts[name]
        _ip("link", "set", host.veth_root, "up")
        self.isolated.discard(name)

    def heal_all(self) -> None:
        for name in list(self.isolated):
            self.heal(name)

    def close(self) -> None:
        """Delete everything this network made; safe to call twice."""
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
