"""ds4serve: exact, fast serving of DeepSeek-V4 models from Python."""

from .config import ModelConfig
from .engine import Engine, ErrorCode, GenerateResult, SamplingParams
from .state import Snapshot

__all__ = ["Engine", "ErrorCode", "GenerateResult", "ModelConfig", "SamplingParams", "Snapshot"]
__version__ = "0.1.0"
