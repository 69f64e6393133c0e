"""What the HTTP handlers share with the rest of the controller, and the hooks not built yet.

The controller creates the state before the pipeline is up (so /health can answer 503), attaches
the engine once it serves, and detaches it when shutting down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from controller.api_request import RequestLimits
from controller.engine import GenerationRequest, RequestHandle
from controller.openai_api.errors import bad_api_key, not_ready, queue_full
from controller.security import token_matches
from controller.tokenizer import Tokenizer


class EngineLike(Protocol):
    """The two calls the API makes on controller.engine.Engine."""

    def add(self, request: GenerationRequest) -> RequestHandle: ...

    def abort(self, request_id: str) -> bool: ...


@dataclass(frozen=True)
class Serving:
    """Everything a generation handler needs, present only while the pipeline serves."""

    engine: EngineLike
    limits: RequestLimits
    tokenizer: Tokenizer


def _never_full() -> bool:
    return False


@dataclass
class HttpApiState:
    model_name: str
    """The id /v1/models lists and responses carry (the model folder's name, as gRPC Status)."""
    api_keys: frozenset[str] = frozenset()
    """When non-empty (--auth-token-file), requests must send `Authorization: Bearer <one of
    these>` or get 401. Empty: no authentication."""
    queue_full: Callable[[], bool] = _never_full
    """Admission control (Engine.queue_full): True refuses new requests with 429."""
    retry_after_s: float = 1.0
    """The 429's Retry-After (AdmissionConfig.retry_after_s, --retry-after)."""
    metrics: Callable[[], tuple[bytes, str]] | None = None
    """The Prometheus exposition and its content type, served on /metrics; None: 404."""
    created_s: int = field(default_factory=lambda: int(time.time()))
    """Unix time the model was loaded (/v1/models `created`)."""
    serving: Serving | None = None

    def attach(self, engine: EngineLike, limits: RequestLimits, tokenizer: Tokenizer) -> None:
        self.serving = Serving(engine, limits, tokenizer)

    def detach(self) -> None:
        """New requests get 503 from now on (shutdown)."""
        self.serving = None

    @property
    def ready(self) -> bool:
        return self.serving is not None

    def require_serving(self) -> Serving:
        if self.serving is None:
            raise not_ready()
        return self.serving

    def authenticate(self, authorization: str | None) -> None:
        if not self.api_keys:
            return
        # The gRPC API's rule: constant-time, against every key.
        if not token_matches(authorization or "", self.api_keys):
            raise bad_api_key()

    def admit(self) -> None:
        if self.queue_full():
            raise queue_full(self.retry_after_s)
