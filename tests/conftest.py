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


# `make test-fast` leaves these out (marker `slow`): Triton-interpreter kernel sweeps, subprocess servers and
# pipelines, and the widest exactness sweeps. `make test` (CI) runs everything.
SLOW_MODULES = {
    "test_decode_kernels",
    "test_faults_shutdown",
    "test_parallel_pipeline",
    "test_parallel_split",
    "test_pdl",
    "test_prefill_graphs",
    "test_prefill_paths",
    "test_regions",
    "test_server_cli",
    "test_speculative_static",
    "test_static_verify",
    "test_two_gpu_bench",
}
SLOW_TESTS = {
    "test_chunking.py::test_fixed_chunk_sizes",
    "test_chunking.py::test_random_lengths_and_splits",
    "test_chunking.py::test_token_by_token",
    "test_constraint.py::test_speculative_constrained_decoding_equals_plain",
    "test_constraint.py::test_the_answer_is_a_document_of_the_schema",
    "test_profiler.py::test_profile_command_prints_tables_and_writes_json_and_plot",
    "test_speculative.py::test_greedy_equals_plain_for_any_width_and_acceptance",
    "test_speculative_drafts.py::test_parked_draft_is_freed_and_reloaded",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        name = f"{item.path.name}::{item.originalname}"
        if module.startswith("test_kernels") or module in SLOW_MODULES or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
