"""Test hosts on one machine: network namespaces joined by veth pairs through a bridge.

Each host is a namespace with `lo` and an `eth0` holding one address of a private /24 that
exists only inside these namespaces; the bridge lives in a namespace of its own, so the machine's
own network is never touched. Everything is removed on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from types import TracebackType

SUBNET = "10.213.7"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"sarathi-probe-{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as err:
        return f"cannot create a network namespace: {err}"
    _ip("netns", "del", probe)
    return None


@dataclass
class TestNetwork:
    __test__ = False  # not a pytest test class

    host_names: list[str]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    addresses: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)

    @property
    def bridge_ns(self) -> str:
        return f"sar-br-{self.tag}"

    def __enter__(self) -> TestNetwork:
        try:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for index, name in enumerate(self.host_names, start=1):
                ns = f"sar-{name}-{self.tag}"
                address = f"{SUBNET}.{index}"
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # veth pair: eth0 in the host namespace, its peer on the bridge
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{index}",
                    "netns", self.bridge_ns)  # fmt: skip
                _ip("-n", self.bridge_ns, "link", "set", f"p{index}", "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", f"p{index}", "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self.namespaces[name] = ns
                self.addresses[name] = address
        except BaseException:
            self.close()
            raise
        return self

    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside host's namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def close(self) -> None:
        for ns in [*self.namespaces.values(), self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.namespaces.clear()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
