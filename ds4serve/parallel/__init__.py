"""Layer split across devices (in one process) and across processes and hosts (torch.distributed)."""

from .placement import plan_split, ranges_from_split, shard_bytes
from .split_model import SplitModel, split_loader

__all__ = ["SplitModel", "plan_split", "ranges_from_split", "shard_bytes", "split_loader"]
