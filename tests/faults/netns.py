"""Real network partitions: a network namespace on a veth pair, and nftables drop rules.

:class:`Partition` makes a namespace ``ce<tag><pid>`` joined to this host by a veth pair
(a /30 of 10.231.0.0/16 derived from the pid). Programs run in it with :meth:`command`
reach the host side's address, where DNAT (``route_localnet`` on the veth only) forwards
the chosen ports to the private servers on 127.0.0.1: nothing else is reachable. A
partition is an nftables ``drop`` inside the namespace, so packets vanish without a reset
or an ICMP error, the way a failed switch or a firewall loses them: ``to_server`` drops
what the namespace sends, ``to_client`` what it receives, ``both`` both. The namespace,
the veth pair and the host's NAT table are removed by :meth:`close`, also after a failure
(the fixture calls it in ``finally``; an ``atexit`` hook is the last resort).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import time

DIRECTIONS = ("both", "to_server", "to_client")
_OPEN: set[Partition | PortIsolation] = set()


class NetnsUnavailable(RuntimeError):
    """Namespaces, veth or nftables cannot be used here (not root, tool missing)."""


def _run(*args: str, stdin: str | None = None) -> None:
    done = subprocess.run(list(args), input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(args)} failed: {done.stderr.strip()[-400:]}")


class Partition:
    """One namespace for a client, and the drop rules that cut it off from the host."""

    def __init__(self, tag: str = "p") -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        for tool in ("ip", "nft"):
            if shutil.which(tool) is None:
                raise NetnsUnavailable(f"{tool} not found (Debian packages iproute2, nftables)")
        pid = os.getpid()
        self.ns = f"ce{tag}{pid}"
        self.host_if = f"ceh{tag}{pid}"[:15]
        self.ns_if = f"cen{tag}{pid}"[:15]
        self.table = f"ce{tag}{pid}"
        n = pid % 16384
        base = f"10.231.{n // 64}.{(n % 64) * 4}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.host_ip = f"{prefix}.{last + 1}"
        self.ns_ip = f"{prefix}.{last + 2}"
        self.ports: list[int] = []
        self.cut: str | None = None

    def open(self, ports: list[int]) -> Partition:
        """Create the namespace and veth pair; forward ``ports`` on the host side to loopback."""
        _OPEN.add(self)
        self.close()  # leftovers of a crashed earlier run with this pid
        _OPEN.add(self)
        self.ports = list(ports)
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.ns)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "-n", self.ns, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        _run("ip", "-n", self.ns, "link", "set", self.ns_if, "up")
        _run("ip", "-n", self.ns, "link", "set", "lo", "up")
        _run("sysctl", "-qw", f"net.ipv4.conf.{self.host_if}.route_localnet=1")
        rules = "\n".join(
            f'    iifname "{self.host_if}" ip daddr {self.host_ip} tcp dport {port} dnat to 127.0.0.1:{port}'
            for port in self.ports
        )
        _run(
            "nft",
            "-f",
            "-",
            stdin=f"table ip {self.table} {{\n  chain pre {{\n    type nat hook prerouting priority -100;\n"
            f"{rules}\n  }}\n}}\n",
        )
        self._ns_nft(
            "table inet cut {\n  chain out {\n    type filter hook output priority 0;\n  }\n"
            "  chain in {\n    type filter hook input priority 0;\n  }\n}\n"
        )
        return self

    def _ns_nft(self, script: str) -> None:
        _run("ip", "netns", "exec", self.ns, "nft", "-f", "-", stdin=script)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def start(self, direction: str = "both") -> float:
        """Drop every packet between the namespace and the host in ``direction``; when it began."""
        if direction not in DIRECTIONS:
            raise ValueError(direction)
        rules = []
        if direction in ("both", "to_server"):
            rules.append(f"add rule inet cut out ip daddr {self.host_ip} drop")
        if direction in ("both", "to_client"):
            rules.append(f"add rule inet cut in ip saddr {self.host_ip} drop")
        self._ns_nft("\n".join(rules) + "\n")
        self.cut = direction
        return time.monotonic()

    def heal(self) -> float:
        """Remove the drop rules; when the network worked again."""
        self._ns_nft("flush chain inet cut out\nflush chain inet cut in\n")
        self.cut = None
        return time.monotonic()

    def close(self) -> None:
        """Delete the NAT table, the veth pair and the namespace (each only if present)."""
        for args in (
            ("nft", "delete", "table", "ip", self.table),
            ("ip", "link", "del", self.host_if),
            ("ip", "netns", "del", self.ns),
        ):
            with contextlib.suppress(Exception):
                subprocess.run(list(args), capture_output=True, timeout=30, check=False)
        _OPEN.discard(self)


class PortIsolation:
    """A server on a loopback port cut off from every TCP peer: an nftables table on this host
    drops every packet to or from ``port`` (both ways, so open connections go silent, without
    a reset). Its Unix socket still works, so a test can keep a client on the isolated side.
    Only that port's packets are touched; :meth:`close` deletes the table (also at exit)."""

    def __init__(self, port: int, tag: str = "i") -> None:
        if os.geteuid() != 0:
            raise NetnsUnavailable("nftables rules need root")
        if shutil.which("nft") is None:
            raise NetnsUnavailable("nft not found (Debian package nftables)")
        self.port = port
        self.table = f"ce{tag}{os.getpid()}p{port}"
        self.cut = False

    def start(self) -> float:
        """Drop the port's packets from now on; when it began."""
        _OPEN.add(self)
        _run(
            "nft",
            "-f",
            "-",
            stdin=f"table inet {self.table} {{\n  chain out {{\n    type filter hook output priority 0;\n"
            f"    tcp dport {self.port} drop\n    tcp sport {self.port} drop\n  }}\n}}\n",
        )
        self.cut = True
        return time.monotonic()

    def heal(self) -> float:
        """Let the port's packets through again; when."""
        self.close()
        return time.monotonic()

    def close(self) -> None:
        """Delete the table if present; safe to call twice."""
        with contextlib.suppress(Exception):
            subprocess.run(
                ["nft", "delete", "table", "inet", self.table], capture_output=True, timeout=30, check=False
            )
        self.cut = False
        _OPEN.discard(self)


@atexit.register
def _close_all() -> None:
    for partition in list(_OPEN):
        partition.close()
