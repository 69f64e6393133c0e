"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health.

Served by the controller on its own port beside gRPC (Starlette on uvicorn, in the controller's
event loop), sharing the engine, the request validation (controller/api_request.py), cancellation
(a dropped connection aborts the sequence) and the engine's metrics with gRPC `Generate`.
"""

from controller.openai_api.server import HttpApiServer, start_http_server
from controller.openai_api.state import HttpApiState

__all__ = ["HttpApiServer", "HttpApiState", "start_http_server"]
