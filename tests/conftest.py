"""Shared fixtures: tiny checkpoints are created once per test session (they take ~1 s each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter; set before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ds4serve.tiny import TinySpec, make_tiny  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_factory(**TinySpec fields)`` → path of a cached tiny checkpoint with those settings."""
    cache: dict[tuple, Path] = {}

    def make(**fields) -> Path:
        key = tuple(sorted(fields.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("tiny")
            cache[key] = make_tiny(out, TinySpec(**fields))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_dir(tiny_factory) -> Path:
    """The default tiny checkpoint (official layout, seed 0, one MTP block)."""
    return tiny_factory(mtp=1)


@pytest.fixture(scope="session")
def engine(tiny_dir):
    """A float32 CPU engine on the default tiny checkpoint (shared: tests must not park it)."""
    from ds4serve import Engine

    return Engine.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def scripted(tiny_dir):
    """A :class:`~tests.server_harness.ScriptedEngine` on the default tiny checkpoint, one per test module (each
    queues its own scripts)."""
    from ds4serve import Engine
    from tests.server_harness import ScriptedEngine

    return ScriptedEngine(Engine.from_pretrained(tiny_dir, max_context=1024))
