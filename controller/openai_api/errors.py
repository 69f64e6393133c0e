"""Errors in OpenAI's JSON shape, so SDKs raise their usual exception classes.

`{"error": {"message", "type", "param", "code"}}` with the HTTP status the SDK maps: 400 ->
BadRequestError, 401 -> AuthenticationError, 404 -> NotFoundError, 429 -> RateLimitError,
503 -> InternalServerError (retried by the SDK, as a pipeline that is down may come back).
"""

from __future__ import annotations

from math import ceil

from starlette.responses import JSONResponse

from controller.scheduler import InvalidRequestError


class ApiError(Exception):
    """An error answer: raised anywhere in a handler, rendered by `error_response`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        """Sent as Retry-After, which OpenAI's SDKs wait for before they retry."""

    def to_json(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(err: InvalidRequestError) -> ApiError:
    """400 with the field in both the message (as gRPC says it) and `param`."""
    return ApiError(400, str(err), param=err.field)


def bad_field(field: str, message: str) -> ApiError:
    return invalid_request(InvalidRequestError(field, message))


def not_ready(retry_after_s: float | None = None) -> ApiError:
    return ApiError(
        503,
        "the pipeline is not ready",
        error_type="service_unavailable",
        code="not_ready",
        retry_after_s=retry_after_s,
    )


def queue_full(retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        f"the request queue is full; retry in {retry_after_s:g} s",
        error_type="rate_limit_error",
        code="queue_full",
        retry_after_s=retry_after_s,
    )


def request_failed(message: str) -> ApiError:
    """500: the request's step failed on the workers, alone too (quarantine.py); not retried
    by the SDK's own rules, as the same request would fail the same way."""
    return ApiError(500, message, error_type="server_error", code="request_failed")


def bad_api_key() -> ApiError:
    return ApiError(
        401,
        "a missing or wrong API key: send `Authorization: Bearer <key>`",
        code="invalid_api_key",
    )


def error_response(err: ApiError) -> JSONResponse:
    # HTTP's Retry-After takes whole seconds.
    headers = None if err.retry_after_s is None else {"Retry-After": str(ceil(err.retry_after_s))}
    return JSONResponse(err.to_json(), status_code=err.status_code, headers=headers)
