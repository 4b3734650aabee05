"""Prefix cache: a radix tree over token ids whose nodes hold right-sized :class:`Snapshot` s.

A request looks up the longest cached prefix of its prompt, restores it and prefills only the rest.
Memory is bounded by a byte budget; eviction removes the least recently used snapshot among those
with no cached descendant, so a prefix shared by several cached sequences (a system prompt, the
early turns of a chat) outlives the branches that extend it.

The optional disk tier writes every inserted snapshot to ``<dir>/<model_id>/<sha256>.safetensors``
(the name hashes the model identity and the token ids; the file carries a checksum of its contents,
model and tokens: :mod:`.snapshot_file`). On start the files of the same model are indexed into the
tree without loading them (leftover temporaries, symbolic links and files whose header is unreadable
or foreign are removed with a warning, and the disk budget is applied); a lookup that ends on a
disk-only node loads and verifies the file and promotes it to memory, and a file that fails is
removed with a warning and the next shorter prefix is tried. A cache never changes an answer. Disk
files outlive memory eviction and restarts; the disk tier has its own byte budget, evicted oldest
first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..state import Snapshot
from .snapshot_file import SUFFIX, TMP_SUFFIX, BadEntry, read_entry, read_header, write_entry

log = logging.getLogger("ds4serve.prefix_cache")


@dataclass
class _Node:
    edge: tuple[int, ...]  # token ids from the parent to this node
    parent: "_Node | None"
    depth: int  # number of tokens from the root to the end of ``edge``
    children: dict[int, "_Node"] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    disk_path: Path | None = None
    has_logits: bool = False  # the cached snapshot kept its last logits
    last_used: float = 0.0

    @property
    def cached(self) -> bool:
        return self.snapshot is not None or self.disk_path is not None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    disk_hits: int = 0
    disk_dropped: int = 0  # disk entries removed as unreadable, damaged or foreign
    inserts: int = 0
    evictions: int = 0


class PrefixCache:
    """Snapshots keyed by their token ids, within ``max_bytes`` of memory (and ``disk_max_bytes`` on disk)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        disk_dir: str | Path | None = None,
        model_id: str = "model",
        disk_max_bytes: int | None = None,
        device: str | torch.device = "cpu",
    ):
        if max_bytes < 0:
            raise ValueError(f"max_bytes: expected >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self.model_id = model_id
        self.disk_dir = Path(disk_dir) / model_id if disk_dir is not None else None
        self.disk_max_bytes = disk_max_bytes
        self.stats = CacheStats()
        self._root = _Node(edge=(), parent=None, depth=0)
        self._bytes = 0
        self._lock = threading.Lock()
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._index_disk()

    # ---- public --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the snapshots held in memory."""
        return self._bytes

    def __len__(self) -> int:
        return sum(1 for n in self._nodes() if n.snapshot is not None)

    def lookup(self, tokens: list[int]) -> Snapshot | None:
        """The snapshot of the longest cached prefix of ``tokens`` that a generation can start from.

        A snapshot covering all of ``tokens`` is usable only if it kept its last logits (nothing is
        left to forward).
        """
        with self._lock:
            while True:
                best: _Node | None = None
                for node in self._path(tokens):
                    if node.cached and (node.depth < len(tokens) or node.has_logits):
                        best = node
                if best is None:
                    self.stats.misses += 1
                    return None
                snap = best.snapshot
                if snap is None:
                    snap = self._load(best)  # a bad file is dropped: try the next shorter prefix
                    if snap is None:
                        continue
                    self.stats.disk_hits += 1
                self.stats.hits += 1
                best.last_used = time.monotonic()
                return snap

    def insert(self, snapshot: Snapshot) -> bool:
        """Cache ``snapshot`` under its tokens (moved to the cache device); False if it cannot fit."""
        if snapshot.pos == 0 or snapshot.pos != len(snapshot.tokens):
            return False
        size = snapshot.nbytes()
        if size > self.max_bytes and self.disk_dir is None:
            return False
        snap = snapshot.to(self.device)
        with self._lock:
            node = self._node_for(snap.tokens)
            node.last_used = time.monotonic()
            node.has_logits = snap.last_logits is not None
            if self.disk_dir is not None and node.disk_path is None:
                node.disk_path = self._write(snap)
                self._trim_disk()
            if size <= self.max_bytes:
                if node.snapshot is not None:
                    self._bytes -= node.snapshot.nbytes()
                node.snapshot = snap
                self._bytes += size
                self._evict(keep=node)
            self.stats.inserts += 1
            return True

    def clear(self) -> None:
        """Drop every in-memory snapshot (disk files stay)."""
        with self._lock:
            for node in self._nodes():
                node.snapshot = None
            self._bytes = 0
            self._prune_all()

    # ---- tree ----------------------------------------------------------------------------------
    def _path(self, tokens: list[int]):
        """Nodes whose full token path is a prefix of ``tokens``, root excluded, shallow first."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i : i + len(child.edge)]) != child.edge:
                return
            node, i = child, i + len(child.edge)
            yield node

    def _node_for(self, tokens: list[int]) -> _Node:
        """The node ending exactly at ``tokens``, splitting an edge or adding a leaf as needed."""
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(edge=tuple(tokens[i:]), parent=node, depth=len(tokens))
                node.children[tokens[i]] = leaf
                return leaf
            common = _common_prefix(child.edge, tokens[i:])
            if common < len(child.edge):
                mid = _Node(edge=child.edge[:common], parent=node, depth=i + common)
                node.children[tokens[i]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + common
        return node

    def _nodes(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tokens_of(self, node: _Node) -> list[int]:
        parts = []
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return [t for edge in reversed(parts) for t in edge]

    def _has_cached_descendant(self, node: _Node, attr: str) -> bool:
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            if getattr(n, attr) is not None:
                return True
            stack.extend(n.children.values())
        return False

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` and empty ancestors when they hold nothing; merge single-child chains."""
        while node is not self._root and not node.cached and len(node.children) <= 1:
            parent = node.parent
            if node.children:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[node.edge[0]] = child
            else:
                del parent.children[node.edge[0]]
            node = parent

    def _prune_all(self) -> None:
        for node in [n for n in self._nodes() if n is not self._root and not n.cached]:
            if node.parent is not None and node.parent.children.get(node.edge[0]) is node:
                self._prune(node)

    # ---- eviction ------------------------------------------------------------------------------
    def _evict(self, keep: _Node) -> None:
        """Free memory down to the budget: LRU first among snapshots with no cached descendant."""
        while self._bytes > self.max_bytes:
            leaves = [
                n
                for n in self._nodes()
                if n.snapshot is not None and n is not keep and not self._has_cached_descendant(n, "snapshot")
            ]
            if not leaves:
                leaves = [n for n in self._nodes() if n.snapshot is not None and n is not keep]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            self._bytes -= victim.snapshot.nbytes()
            victim.snapshot = None
            self.stats.evictions += 1
            self._prune(victim)

    def _trim_disk(self) -> None:
        if self.disk_max_bytes is None:
            return
        files = [n for n in self._nodes() if n.disk_path is not None]
        total = sum(_file_size(n.disk_path) for n in files)
        for node in sorted(files, key=lambda n: n.last_used):
            if total <= self.disk_max_bytes:
                break
            total -= _file_size(node.disk_path)
            node.disk_path.unlink(missing_ok=True)
            node.disk_path = None
            self._prune(node)

    # ---- disk tier -----------------------------------------------------------------------------
    def key(self, tokens: list[int]) -> str:
        """File stem of a token prefix: sha256 over the model identity and the token ids."""
        h = hashlib.sha256(self.model_id.encode())
        h.update(b"\0")
        h.update(json.dumps(tokens).encode())
        return h.hexdigest()

    def _write(self, snap: Snapshot) -> Path | None:
        """Write ``snap``'s file (the folder made again if it was removed); None, with a warning, on failure."""
        try:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            return write_entry(self.disk_dir, self.key(snap.tokens), snap, self.model_id)
        except OSError as exc:
            log.warning("prefix cache: could not write %s: %s", self.disk_dir / self.key(snap.tokens), exc)
            return None

    def _load(self, node: _Node) -> Snapshot | None:
        """The verified snapshot of a disk-only node (promoted to memory), or None after dropping its file."""
        try:
            snap = read_entry(node.disk_path, self.model_id, self._tokens_of(node)).to(self.device)
        except (BadEntry, OSError) as exc:
            self._drop_file(node.disk_path, exc)
            node.disk_path = None
            self._prune(node)
            return None
        size = snap.nbytes()
        if size <= self.max_bytes:
            node.snapshot = snap
            self._bytes += size
            self._evict(keep=node)
        return snap

    def _drop_file(self, path: Path, why: object) -> None:
        log.warning("prefix cache: removing bad entry %s: %s", path, why)
        self.stats.disk_dropped += 1
        path.unlink(missing_ok=True)

    def _index_disk(self) -> None:
        """Index this model's entries by their headers; remove temporaries, links and bad entries."""
        for path in sorted(self.disk_dir.iterdir()):
            if path.is_symlink():
                self._drop_file(path, "a symbolic link (never followed)")
            elif path.name.endswith(TMP_SUFFIX):
                log.info("prefix cache: removing the leftover temporary %s", path)
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX) and path.is_file():
                try:
                    meta = read_header(path)
                    tokens = json.loads(meta["tokens"])
                    ok = (
                        meta.get("model_id") == self.model_id
                        and isinstance(tokens, list)
                        and tokens
                        and path.name == self.key(tokens) + SUFFIX
                    )
                except (BadEntry, KeyError, TypeError, ValueError, RecursionError) as exc:
                    self._drop_file(path, exc)
                    continue
                if not ok:
                    self._drop_file(path, "the entry belongs to another model or token prefix")
                    continue
                node = self._node_for(tokens)
                node.disk_path = path
                node.has_logits = meta.get("has_logits") == "1"
                node.last_used = path.stat().st_mtime - time.time() + time.monotonic()
        self._prune_all()
        self._trim_disk()


def model_identity(path: str | Path, dtype: str) -> str:
    """A short id of a checkpoint's exact weights: its config, shard sizes and first bytes, and dtype.

    Two tiny random checkpoints share a config, so a prefix of each shard's contents is hashed too.
    """
    path = Path(path)
    h = hashlib.sha256(dtype.encode())
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for shard in sorted(path.glob("*.safetensors")):
        h.update(shard.name.encode())
        h.update(str(shard.stat().st_size).encode())
        with shard.open("rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
