"""The worker's one socket to the controller, shared by the main thread and a keepalive thread.

The main thread sends and receives between steps. While it steps (or zeroes its KV cache) it
answers nothing, so the keepalive thread speaks for it: `alive` every BUSY_KEEPALIVE_S (a step
longer than the controller's heartbeat timeout is not a dead worker). While a step waits on a
neighbouring stage, the thread also reads the controller's messages: the pings' progress tells
a neighbour still stepping (a long wait that will end) from a cut link (one that will not), and
a shutdown says the pipeline is down (the wait's end does not matter). Messages other than
pings are kept, in order, for the main thread.

ZeroMQ sockets are not thread-safe: a lock hands the socket over, and the thread never waits
for it (the main thread's sends and polls come first).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import zmq
from sarathi_proto import stage_pb2

from stage_worker.step_timer import clock

logger = logging.getLogger(__name__)

# How often a busy worker says it lives: a step answers nothing until it ends, and one
# longer than the controller's heartbeat timeout (5 s by default; a whole prompt of a thousand
# tokens on a CPU thread takes longer) would count the worker down mid-step.
BUSY_KEEPALIVE_S = 0.25


@dataclass(frozen=True)
class PeerWait:
    """The main thread waits on stage `neighbour`, for its activations of micro-batch
    `batch_id` (they come at the end of its step) or for it to take ours of `batch_id` (at the
    start of its step): until that stage has finished `batch_id`, the wait is its work."""

    neighbour: int
    batch_id: int

    def neighbour_busy(self, last_batch_ids: Sequence[int]) -> bool:
        """The controller's progress (by stage, the last micro-batch finished) says the
        neighbour is still stepping batch_id or one before it: the wait is its work."""
        return (
            self.neighbour < len(last_batch_ids) and last_batch_ids[self.neighbour] < self.batch_id
        )


class ControlSocket:
    """The socket and its keepalive thread (start, stop); the main thread's send and recv."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._inbox: deque[stage_pb2.ControllerMessage] = deque()
        self._last_sent_s = time.monotonic()
        self.heard_s = time.monotonic()
        """time.monotonic() when the controller was last heard from, by either thread."""
        self.received_at = 0.0
        """clock() when the main thread took the message recv returned last: off the socket,
        before parsing, or from those the keepalive thread kept (a step's time starts there,
        not while the step before it ran)."""
        self._busy = threading.Event()
        self._hearing: tuple[PeerWait | None, Callable[[], object], Callable[[], object]] | None = (
            None
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="keepalive", daemon=True)

    # ---- the main thread -------------------------------------------------------------------
    def send(self, msg: stage_pb2.WorkerMessage) -> None:
        data = msg.SerializeToString()
        with self._lock:
            self._sock.send(data)
            self._last_sent_s = time.monotonic()

    def recv(self, timeout_s: float | None = None) -> stage_pb2.ControllerMessage | None:
        """The next message (those the keepalive thread kept first), or None after timeout_s."""
        with self._lock:
            if self._inbox:
                self.received_at = clock()
                return self._inbox.popleft()
            if timeout_s is not None and not self._sock.poll(int(timeout_s * 1000)):
                return None
            data = self._sock.recv()
        self.received_at = clock()
        self.heard_s = time.monotonic()
        return stage_pb2.ControllerMessage.FromString(data)

    def reconnect(self, sock: zmq.Socket) -> None:
        """Another controller: the old socket closes, and what it delivered is dropped."""
        with self._lock:
            self._sock.close(linger=0)
            self._sock = sock
            self._inbox.clear()
            self.heard_s = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)

    def send_last(self, msg: stage_pb2.WorkerMessage, linger_s: float) -> None:
        """Sends msg as the last message and waits up to linger_s for it to leave: the process
        exits next, and os._exit does not wait for ZeroMQ's I/O thread to send what is queued.
        The keepalive thread finds the lock held or the socket closed, and stops."""
        self._stop.set()
        with self._lock:
            try:
                # Not blocking: a queue full of messages to a controller that reads none
                # would hold the exit for ever.
                self._sock.send(msg.SerializeToString(), zmq.NOBLOCK)
            finally:
                # Every socket of the context closed, its queued messages waited for (linger).
                self._sock.context.destroy(linger=int(linger_s * 1000))

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """While inside (a step, zeroing the KV cache), the keepalive thread says the worker
        lives."""
        self._busy.set()
        try:
            yield
        finally:
            self._busy.clear()

    @contextlib.contextmanager
    def hearing(
        self,
        wait: PeerWait | None,
        neighbour_busy: Callable[[], object],
        pipeline_down: Callable[[], object],
    ) -> Iterator[None]:
        """While inside (a step waiting on a neighbour; joining the pipeline: wait None), the
        keepalive thread reads the controller's messages: it calls neighbour_busy for each ping
        that says so, and pipeline_down for a shutdown (the controller took the pipeline down:
        whatever the neighbour does, this step's result is not wanted)."""
        self._hearing = (wait, neighbour_busy, pipeline_down)
        try:
            yield
        finally:
            self._hearing = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # ---- the keepalive thread --------------------------------------------------------------
    def _keepalive(self) -> None:
        alive = stage_pb2.WorkerMessage(alive=True).SerializeToString()
        while not self._stop.wait(BUSY_KEEPALIVE_S):
            if not self._busy.is_set() or not self._lock.acquire(blocking=False):
                continue
            try:
                hearing = self._hearing
                if hearing is not None:
                    self._read_while_waiting(*hearing)
                if time.monotonic() - self._last_sent_s >= BUSY_KEEPALIVE_S:
                    self._sock.send(alive, zmq.NOBLOCK)
                    self._last_sent_s = time.monotonic()
            except zmq.ZMQError:  # the queue to a cut link is full: its silence is the news
                pass
            except Exception:  # a thread that died here would leave long steps unspoken for
                logger.exception("keepalive: a message from the controller went wrong")
            finally:
                self._lock.release()

    def _read_while_waiting(
        self,
        wait: PeerWait | None,
        neighbour_busy: Callable[[], object],
        pipeline_down: Callable[[], object],
    ) -> None:
        """Everything waiting on the socket (the lock held), as `hearing` says; all but pings
        are kept for the main thread."""
        while self._sock.poll(0):
            data = self._sock.recv(zmq.NOBLOCK)
            self.heard_s = time.monotonic()
            msg = stage_pb2.ControllerMessage.FromString(data)
            if msg.HasField("ping"):
                if wait is not None and wait.neighbour_busy(msg.ping.last_batch_ids):
                    neighbour_busy()
                continue
            self._inbox.append(msg)
            if msg.HasField("shutdown"):
                pipeline_down()
