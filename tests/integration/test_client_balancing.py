"""Client-side balancing over several controllers, as over the chart's headless Service.

Two real gRPC servers answer Status with their own model name; one `sarathictl` client over a
target that resolves to both must alternate between them. The target here is gRPC's static
`ipv4:` list, which goes through the same round-robin policy as `dns:///<headless Service>:<port>`
(a name with several addresses cannot be made on loopback without editing /etc/hosts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from sarathi_proto import generate_pb2, generate_pb2_grpc
from sarathictl.client import Client

pytestmark = pytest.mark.integration


class _NamedController(generate_pb2_grpc.GenerationServicer):
    def __init__(self, name: str) -> None:
        self.name = name

    def Status(
        self, request: generate_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> generate_pb2.StatusResponse:
        return generate_pb2.StatusResponse(model=self.name, serving=True)


@pytest.fixture
def two_controllers() -> Iterator[list[int]]:
    servers, ports = [], []
    for name in ("pipeline-0", "pipeline-1"):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        generate_pb2_grpc.add_GenerationServicer_to_server(_NamedController(name), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
    yield ports
    for server in servers:
        server.stop(grace=None)


def test_calls_alternate_over_every_address_of_the_target(two_controllers: list[int]) -> None:
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in two_controllers)
    with Client(target) as client:
        # Round robin sends calls to the subchannels that are READY; the first call waits for
        # one alone. Count only once both have answered (a pick-first policy never would).
        seen = {client.status(timeout_s=10).model}
        for _ in range(200):  # 10 s at most
            if len(seen) == 2:
                break
            time.sleep(0.05)
            seen.add(client.status(timeout_s=10).model)
        answered = [client.status(timeout_s=10).model for _ in range(6)]
    assert sorted(set(answered)) == ["pipeline-0", "pipeline-1"]
    assert answered.count("pipeline-0") == 3  # round robin, not pick-first


def test_a_plain_address_still_reaches_its_one_controller(two_controllers: list[int]) -> None:
    with Client(f"127.0.0.1:{two_controllers[1]}") as client:
        assert {client.status(timeout_s=10).model for _ in range(3)} == {"pipeline-1"}
