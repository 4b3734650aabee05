"""Stateless DeepSeek-V4 modules; all mutable inference state lives in :mod:`ds4serve.state`."""

from .deepseek4 import DeepSeekV4, ForwardResult

__all__ = ["DeepSeekV4", "ForwardResult"]
