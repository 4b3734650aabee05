"""The checked disk tier: a damaged, foreign or linked entry is skipped, removed and named in a warning, at
start and while running; the server still starts, and its answers equal the uncached ones bitwise."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load, save

from ds4serve import Engine
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.engine.snapshot_file import read_header
from ds4serve.server.app import ServerConfig, create_app
from ds4serve.state import Snapshot

from .server_harness import running


def snap(tokens: list[int], fill: float | None = None) -> Snapshot:
    value = float(len(tokens)) if fill is None else fill
    return Snapshot(
        pos=len(tokens),
        tokens=list(tokens),
        layers={0: {"window": torch.full((4, 8), value)}},
        last_logits=torch.full((16,), value),
    )


def entry(cache: PrefixCache, tokens: list[int]) -> Path:
    return cache.disk_dir / f"{cache.key(tokens)}.safetensors"


def truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path, other: Path) -> None:
    path.write_bytes(b"")


def random_bytes(path: Path, other: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def corrupt_header(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def flip_bits(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def foreign_tensors(path: Path, other: Path) -> None:
    """Another prompt's tensors under this entry's own metadata (checksum included)."""
    meta = read_header(path)
    path.write_bytes(save(load(other.read_bytes()), metadata=meta))


def foreign_file(path: Path, other: Path) -> None:
    """Another prompt's whole entry under this entry's name."""
    path.write_bytes(other.read_bytes())


def symlink(path: Path, other: Path) -> None:
    """A link out of the directory, to a valid copy of this very entry."""
    outside = path.parent.parent.parent / "outside.safetensors"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


FAULTS = [truncate, empty, random_bytes, corrupt_header, flip_bits, foreign_tensors, foreign_file, symlink]


def damaged_cache(tmp_path: Path, fault) -> tuple[PrefixCache, Path]:
    cache = PrefixCache(0, disk_dir=tmp_path / "cache", model_id="m")  # disk only: every hit reads a file
    cache.insert(snap([1, 2]))
    cache.insert(snap([1, 2, 3, 4]))
    cache.insert(snap([7, 7, 7, 7], fill=-1.0))
    fault(entry(cache, [1, 2, 3, 4]), entry(cache, [7, 7, 7, 7]))
    return cache, entry(cache, [1, 2, 3, 4])


def check_dropped(cache: PrefixCache, path: Path, caplog) -> None:
    got = cache.lookup([1, 2, 3, 4, 5])
    assert got.tokens == [1, 2] and torch.equal(got.layers[0]["window"], torch.full((4, 8), 2.0))
    assert not path.exists() and not path.is_symlink()
    assert any(r.levelno == logging.WARNING and path.name in r.getMessage() for r in caplog.records)
    assert cache.lookup([1, 2, 3, 4, 5]).tokens == [1, 2]  # gone for good, no second warning needed
    assert cache.lookup([7, 7, 7, 7, 1]).tokens == [7, 7, 7, 7]  # the other entries are intact


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_bad_entry_at_start_is_removed_with_a_warning(tmp_path, caplog, fault):
    _, path = damaged_cache(tmp_path, fault)
    caplog.set_level(logging.WARNING, "ds4serve.prefix_cache")
    restarted = PrefixCache(0, disk_dir=tmp_path / "cache", model_id="m")
    check_dropped(restarted, path, caplog)
    assert (tmp_path / "outside.safetensors").exists() or fault is not symlink  # the link's target is left


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_bad_entry_while_running_is_removed_with_a_warning(tmp_path, caplog, fault):
    cache, path = damaged_cache(tmp_path, fault)
    caplog.set_level(logging.WARNING, "ds4serve.prefix_cache")
    check_dropped(cache, path, caplog)
    assert cache.stats.disk_dropped == 1


def test_a_cache_folder_removed_while_running_is_made_again_and_its_entries_miss(tmp_path):
    """The disk tier's folder deleted under a running server: the entries it held are misses, and the next
    snapshot makes the folder again and is read back."""
    cache = PrefixCache(0, disk_dir=tmp_path / "cache", model_id="m")
    cache.insert(snap([1, 2, 3]))
    shutil.rmtree(tmp_path / "cache")
    assert cache.lookup([1, 2, 3, 4]) is None
    cache.insert(snap([5, 6]))
    assert entry(cache, [5, 6]).exists() and cache.lookup([5, 6, 7]).tokens == [5, 6]


def test_start_cleans_temporaries_and_applies_the_disk_budget(tmp_path):
    cache = PrefixCache(0, disk_dir=tmp_path, model_id="m")
    for i in range(4):
        cache.insert(snap([i + 1, 9]))
    assert not list(cache.disk_dir.glob("*.tmp"))  # writes go through a temporary renamed into place
    (cache.disk_dir / ".half-written.1234.tmp").write_bytes(b"partial")
    one = entry(cache, [1, 9]).stat().st_size
    restarted = PrefixCache(0, disk_dir=tmp_path, model_id="m", disk_max_bytes=2 * one)
    assert not list(restarted.disk_dir.glob("*.tmp"))
    assert len(list(restarted.disk_dir.glob("*.safetensors"))) == 2


def completion(base: str, prompt: list[int], **params) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "logprobs": 2, **params}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


PROMPT = [(i * 37 + 5) % 200 + 3 for i in range(40)]
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 5}]


@pytest.fixture(scope="module")
def engine_1k(tiny_dir):
    return Engine.from_pretrained(tiny_dir, max_context=1024)


@pytest.fixture(scope="module")
def uncached(engine_1k):
    with running(create_app(engine_1k, ServerConfig(model_name="tiny"))) as base:
        return [completion(base, PROMPT + [11, 12], **s) for s in SAMPLINGS]


def test_server_with_damaged_entries_answers_as_uncached(engine_1k, uncached, tmp_path, caplog):
    """Entries damaged while the server runs, then others damaged before a restart: every answer (greedy and
    seeded, logprobs included) equals the uncached one, /health answers, and each bad file is gone."""
    caplog.set_level(logging.WARNING, "ds4serve.prefix_cache")

    def serve():
        cache = PrefixCache(0, disk_dir=tmp_path / "cache", model_id="tiny")
        return running(create_app(engine_1k, ServerConfig(model_name="tiny"), cache)), cache

    other = tmp_path / "other.safetensors"  # an entry of another prompt
    PrefixCache(0, disk_dir=tmp_path / "elsewhere", model_id="tiny").insert(snap([5, 6, 7]))
    os.replace(next((tmp_path / "elsewhere" / "tiny").iterdir()), other)
    server, cache = serve()
    with server as base:
        for fault in (flip_bits, foreign_tensors, truncate):
            completion(base, PROMPT, max_tokens=1)  # caches PROMPT (and PROMPT + its token) on disk
            files = sorted(cache.disk_dir.iterdir())  # with the last round's PROMPT + [11, 12]: all damaged
            read = entry(cache, PROMPT)  # what the next prompts restore, once their own entry is found bad
            assert read in files
            for path in files:
                fault(path, other)
            assert [completion(base, PROMPT + [11, 12], **s) for s in SAMPLINGS] == uncached
            assert not read.exists(), fault.__name__
    server, cache = serve()
    with server as base:
        for n in (10, 20, 30, 40):  # four nested prefixes of the prompt, each its own entry
            completion(base, PROMPT[:n], max_tokens=1)
        completion_files = [p for p in cache.disk_dir.iterdir() if p.name.endswith(".safetensors")]
    faults = (empty, corrupt_header, symlink, random_bytes)
    for i, path in enumerate(completion_files):  # every entry damaged: an answer from the cache would differ
        faults[i % len(faults)](path, path)
    server, cache = serve()
    with server as base:
        assert httpx.get(f"{base}/health").json()["status"] == "ok"
        assert [completion(base, PROMPT + [11, 12], **s) for s in SAMPLINGS] == uncached
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert completion_files and all(p.name in warned for p in completion_files)


def test_a_shared_system_prompt_is_reused_on_first_encounter(engine_1k):
    """Two clients, one system prompt, different questions: the second restores the system prompt that the first
    one's request cached at its turn boundary (no earlier request ended there)."""
    system = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(60))
    tok = engine_1k.tokenizer
    app = create_app(engine_1k, ServerConfig(model_name="tiny"), PrefixCache(256 << 20))
    with running(app) as base:

        def ask(question: str) -> dict:
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            }
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]

        first = ask("What is the capital of France?")
        second = ask("How many legs does a spider have?")
    shared = len(tok.encode("<｜begin▁of▁sentence｜>" + system))  # the system block, up to <｜User｜>
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == shared > 60
