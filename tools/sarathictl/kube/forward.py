"""A port-forward made by the command itself: a local TCP port whose every connection is carried
to a pod's port through the API server (the pod's `portforward` subresource, as `kubectl
port-forward` does), so the gRPC client reaches a controller from outside the cluster."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024


class PortForward:
    def __init__(self, core: Any, namespace: str, pod: str, port: int) -> None:
        """core: a kubernetes.client.CoreV1Api."""
        self.core, self.namespace, self.pod, self.port = core, namespace, pod, port
        self.last_error = ""
        """Why the API server refused the last connection (for the 'unreachable' message)."""
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name=f"port-forward {pod}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                local, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._carry, args=(local,), daemon=True).start()

    def _carry(self, local: socket.socket) -> None:
        from kubernetes.stream import portforward

        try:
            forward = portforward(
                self.core.connect_get_namespaced_pod_portforward,
                self.pod,
                self.namespace,
                ports=str(self.port),
            )
            remote = forward.socket(self.port)
        except Exception as err:  # refused (RBAC, pod gone): the gRPC call sees a closed socket
            self.last_error = f"{type(err).__name__}: {err}".splitlines()[0]
            local.close()
            return
        remote.setblocking(True)
        done = threading.Thread(target=_pump, args=(remote, local), daemon=True)
        done.start()
        _pump(local, remote)
        done.join()
        local.close()
        remote.close()
        error = forward.error(self.port)  # what the API server sent on the error channel
        if error:
            self.last_error = error.strip().splitlines()[0]

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pump(src: Any, dst: Any) -> None:
    """Copies src to dst until src ends, then ends dst's sending side."""
    with contextlib.suppress(OSError):
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
