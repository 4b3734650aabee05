"""The inference engine: prefill, decode, sampling, snapshots and the request lifecycle."""

from .engine import Engine, RequestHandle
from .request import ErrorCode, GenerateError, GenerateResult, SamplingParams, TokenLogprob

__all__ = [
    "Engine",
    "RequestHandle",
    "ErrorCode",
    "GenerateError",
    "GenerateResult",
    "SamplingParams",
    "TokenLogprob",
]
