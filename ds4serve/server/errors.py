"""HTTP errors: the engine's :class:`ErrorCode` mapped to statuses, rendered in OpenAI or Anthropic shape.

Every failure leaves the server with a non-2xx status (or, once a stream has started, an error event
followed by the end of the stream); nothing is reported as a successful empty completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.request import ErrorCode

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_OVERFLOW: 400,
    ErrorCode.MODEL_PARKED: 503,
    ErrorCode.CANCELLED: 499,  # the client went away; nobody reads this response
    ErrorCode.OUT_OF_MEMORY: 500,
    ErrorCode.INTERNAL: 500,
}

# Error ``type`` strings of each provider, by status.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "cancelled",
    503: "overloaded_error",
}


@dataclass
class APIError(Exception):
    """An HTTP error: status, message, a machine-readable code and the offending field."""

    status: int
    message: str
    code: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    details: dict | None = None  # Anthropic's error ``details`` (what its SDKs act on), where there are some

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    @classmethod
    def from_code(cls, code: ErrorCode, message: str, param: str | None = None) -> "APIError":
        headers = {"Retry-After": "5"} if code is ErrorCode.MODEL_PARKED else {}
        return cls(STATUS[code], message, code.value, param, headers)


def unavailable(message: str) -> APIError:
    """503 with Retry-After: the server is shutting down."""
    return APIError(503, message, "unavailable", headers={"Retry-After": "5"})


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, ErrorCode.INVALID_REQUEST.value, param)


def context_overflow(max_context: int, prompt: int, completion: int, field: str = "messages") -> APIError:
    """The OpenAI wording, so clients that parse it (to trim history) keep working; ``field`` holds the prompt
    (``messages``, or ``prompt`` for text completions)."""
    return APIError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the {field}, {completion} in the completion). "
        f"Please reduce the length of the {field} or completion.",
        "context_length_exceeded",
        field,
    )


def anthropic_context_overflow(max_context: int, prompt: int, completion: int) -> APIError:
    """Anthropic's wording, which Claude Code matches: "prompt is too long" (it compacts the conversation) when
    the prompt alone is over the context, else the sum over the limit (it retries with a smaller ``max_tokens``).
    Both state ``max_context``, the limit ``/v1/models`` gives as ``max_input_tokens`` and OpenAI's wording names."""
    if prompt > max_context:
        message = f"prompt is too long: {prompt} tokens > {max_context} maximum"
    else:
        message = (
            f"input length and `max_tokens` exceed context limit: {prompt} + {completion} > {max_context}, "
            "decrease input length or `max_tokens` and try again"
        )
    return APIError(400, message, "context_length_exceeded", "messages")


def openai_body(err: APIError) -> dict:
    kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_body(err: APIError) -> dict:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    error = {"type": kind, "message": err.message}
    return {"type": "error", "error": error if err.details is None else {**error, "details": err.details}}


def body_for(path: str, err: APIError) -> dict:
    """The error shape of the API ``path`` belongs to (Anthropic under /v1/messages, else OpenAI)."""
    return anthropic_body(err) if path.startswith("/v1/messages") else openai_body(err)
