"""The inference engine: prefill, decode, sampling, snapshots and the request lifecycle."""

from .engine import Engine
from .request import ErrorCode, GenerateError, GenerateResult, SamplingParams, TokenLogprob
from .step_loop import RequestHandle

__all__ = [
    "Engine",
    "RequestHandle",
    "ErrorCode",
    "GenerateError",
    "GenerateResult",
    "SamplingParams",
    "TokenLogprob",
]
