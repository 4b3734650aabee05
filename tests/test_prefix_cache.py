"""Prefix cache: longest-prefix lookup, byte budget with LRU eviction that keeps shared ancestors,
the disk tier across restarts, and exact continuation from a cached snapshot."""

from __future__ import annotations

import torch

from ds4serve import SamplingParams
from ds4serve.engine.prefix_cache import PrefixCache, model_identity
from ds4serve.state import Snapshot

from .helpers import random_prompt


def snap(tokens: list[int], logits: bool = True, rows: int = 4) -> Snapshot:
    """A synthetic snapshot whose tensor contents encode its length (to check what comes back)."""
    n = len(tokens)
    return Snapshot(
        pos=n,
        tokens=list(tokens),
        layers={0: {"window": torch.full((rows, 8), float(n))}},
        last_logits=torch.full((16,), float(n)) if logits else None,
    )


SIZE = snap([1]).nbytes()


def test_lookup_returns_longest_usable_prefix():
    cache = PrefixCache(100 * SIZE)
    for t in ([1, 2], [1, 2, 3, 4], [1, 2, 9], [5]):
        assert cache.insert(snap(t))
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3]).tokens == [1, 2]
    assert cache.lookup([1, 2, 9, 9]).tokens == [1, 2, 9]
    assert cache.lookup([7, 1, 2]) is None
    assert cache.stats.hits == 3 and cache.stats.misses == 1


def test_exact_match_needs_logits():
    cache = PrefixCache(100 * SIZE)
    cache.insert(snap([1, 2], logits=False))
    cache.insert(snap([1], logits=True))
    assert cache.lookup([1, 2]).tokens == [1]  # nothing left to forward, and no logits to sample from
    assert cache.lookup([1, 2, 3]).tokens == [1, 2]


def test_budget_evicts_lru_leaf_and_keeps_shared_ancestor():
    cache = PrefixCache(3 * SIZE)
    cache.insert(snap([1, 2]))  # the shared system prompt: oldest
    cache.insert(snap([1, 2, 3]))
    cache.insert(snap([1, 2, 4]))
    cache.lookup([1, 2, 3, 0])  # [1,2,3] is now more recent than [1,2,4]
    cache.insert(snap([1, 2, 5]))  # over budget: the LRU leaf [1,2,4] goes, not the older ancestor
    assert cache.nbytes == 3 * SIZE and len(cache) == 3
    assert cache.lookup([1, 2, 4, 0]).tokens == [1, 2]
    assert cache.lookup([1, 2, 3, 0]).tokens == [1, 2, 3]
    assert cache.stats.evictions == 1


def test_too_large_or_empty_snapshots_are_not_kept():
    cache = PrefixCache(SIZE - 1)
    assert not cache.insert(snap([1]))
    assert not PrefixCache(10 * SIZE).insert(snap([]))
    assert cache.lookup([1, 2]) is None


def test_disk_tier_survives_restart_and_is_per_model(tmp_path):
    first = PrefixCache(10 * SIZE, disk_dir=tmp_path, model_id="m1")
    first.insert(snap([3, 1, 4]))
    first.insert(snap([3, 1, 4, 1, 5], logits=False))
    restarted = PrefixCache(10 * SIZE, disk_dir=tmp_path, model_id="m1")
    assert len(restarted) == 0  # indexed, not loaded
    got = restarted.lookup([3, 1, 4, 1, 5, 9])
    assert got.tokens == [3, 1, 4, 1, 5] and got.last_logits is None
    assert torch.equal(got.layers[0]["window"], torch.full((4, 8), 5.0))
    assert restarted.lookup([3, 1, 4, 1, 5]).tokens == [3, 1, 4]  # exact match needs logits: the shorter one
    assert restarted.stats.disk_hits == 2
    other = PrefixCache(10 * SIZE, disk_dir=tmp_path, model_id="m2")
    assert other.lookup([3, 1, 4, 1, 5, 9]) is None


def test_disk_budget_drops_oldest_files(tmp_path):
    cache = PrefixCache(0, disk_dir=tmp_path, model_id="m", disk_max_bytes=1)
    cache.insert(snap([1, 2]))
    cache.insert(snap([7, 8]))
    assert len(list((tmp_path / "m").glob("*.safetensors"))) <= 1


def test_model_identity_tells_checkpoints_apart(tiny_dir, tiny_factory):
    other = tiny_factory(seed=7, mtp=1)
    assert model_identity(tiny_dir, "float32") == model_identity(tiny_dir, "float32")
    assert model_identity(tiny_dir, "float32") != model_identity(other, "float32")
    assert model_identity(tiny_dir, "float32") != model_identity(tiny_dir, "bfloat16")


def test_cached_snapshot_through_disk_continues_exactly(engine, tmp_path):
    """A snapshot written to disk, reloaded by a new cache and restored equals never having stopped."""
    prompt = random_prompt(40, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    cold = engine.generate(prompt + [17, 23], params)
    engine.generate(prompt, SamplingParams(max_tokens=1))
    PrefixCache(1 << 30, disk_dir=tmp_path, model_id="t").insert(engine.snapshot("cpu"))
    restored = PrefixCache(1 << 30, disk_dir=tmp_path, model_id="t").lookup(prompt + [17, 23])
    assert restored is not None and restored.pos == len(prompt)
    warm = engine.generate(prompt + [17, 23], params, snapshot=restored)
    assert warm.stats.prefilled_tokens == 2 and warm.stats.cached_tokens == len(prompt)
    assert warm.tokens == cold.tokens
