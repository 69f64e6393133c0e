"""Test hosts on one machine: network namespaces joined by veth pairs through a bridge.

Each host is a namespace with `lo` and an `eth0` holding one address of a private /24 that
exists only inside these namespaces; the bridge lives in a namespace of its own, so the machine's
own network is never touched. Everything is removed on exit.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import shutil
import socket
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

SUBNET = "10.213.7"
_CLONE_NEWNET = 0x40000000


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
    _forwards: list[UnixForward] = field(default_factory=list, init=False, repr=False)

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

    def set_link(self, host: str, up: bool) -> None:
        """Takes host's link down (a cable pulled: no packet in or out, no socket closed) or
        brings it back up."""
        index = self.host_names.index(host) + 1
        _ip("-n", self.bridge_ns, "link", "set", f"p{index}", "up" if up else "down")

    def forward(self, host: str, port: int, unix_path: Path) -> UnixForward:
        """A Unix socket at unix_path, in this process's file system, whose connections reach
        host's address and port inside its namespace (for clients that run in the test process:
        `grpc.insecure_channel(f"unix:{unix_path}")`). Closed with the network."""
        forward = UnixForward(self.namespaces[host], (self.addresses[host], port), unix_path)
        self._forwards.append(forward)
        return forward

    def close(self) -> None:
        for forward in self._forwards:
            forward.close()
        self._forwards.clear()
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


def _enter_namespace(ns: str) -> None:
    """Moves the calling thread (only it) into network namespace ns."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


class UnixForward:
    """Relays each connection to a Unix socket to a TCP address inside a namespace. One thread,
    inside the namespace, copies bytes both ways; when either side closes, so does the other (a
    client sees the server go away as it would over TCP)."""

    def __init__(self, ns: str, target: tuple[str, int], unix_path: Path) -> None:
        self.path = unix_path
        self._target = target
        self._ns = ns
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(unix_path))
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._run, name=f"forward-{ns}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _enter_namespace(self._ns)
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.1):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    if sock is self._listener:
                        client, _ = sock.accept()
                        try:
                            upstream = socket.create_connection(self._target, timeout=5)
                        except OSError:
                            client.close()  # refused: the client sees an unreachable server
                            continue
                        client.settimeout(5)
                        peers[client], peers[upstream] = upstream, client
                        sel.register(client, selectors.EVENT_READ)
                        sel.register(upstream, selectors.EVENT_READ)
                        continue
                    other = peers.get(sock)
                    if other is None:
                        continue
                    try:
                        data = sock.recv(1 << 16)
                        if data:
                            other.sendall(data)
                            continue
                    except OSError:
                        pass
                    for end in (sock, other):
                        sel.unregister(end)
                        peers.pop(end, None)
                        end.close()
        finally:
            for end in peers:
                end.close()
            sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        self.path.unlink(missing_ok=True)
