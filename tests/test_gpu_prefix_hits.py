"""Requests as the server runs them on CUDA (issue 36): greedy, sampled and seeded, plain and speculative, each
uncached and then restoring its whole prompt from a host snapshot, as the prefix cache keeps them (the first token
is sampled from the snapshot's host copy of the logits). All succeed; greedy and seeded plain ones give the
uncached answer. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_engine(tiny_dir):
    return Engine.from_pretrained(tiny_dir, device="cuda:0", max_context=512)


@pytest.mark.parametrize("speculative", [None, "mtp"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 7), (0.8, None)])
def test_a_whole_prompt_restored_from_a_host_snapshot(gpu_engine, speculative, temperature, seed):
    prompt = [0, *range(1000, 1040)]
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed)
    uncached = gpu_engine.generate(prompt, params, speculative=speculative)
    assert uncached.ok, uncached.error_message
    gpu_engine.generate(prompt, SamplingParams(max_tokens=1))  # the state now ends with the prompt
    snapshot = gpu_engine.snapshot("cpu")
    assert snapshot.last_logits.device.type == "cpu"
    hits = [gpu_engine.generate(prompt, params, speculative=speculative, snapshot=snapshot) for _ in range(2)]
    for hit in hits:
        assert hit.ok, hit.error_message
        assert hit.stats.cached_tokens == len(prompt) and hit.stats.prefilled_tokens == 0
    if temperature == 0 or (seed is not None and speculative is None):
        # a sampled speculative answer draws as its drafts go, and those follow the proposer's own history
        assert hits[0].tokens == hits[1].tokens == uncached.tokens


def test_speculative_requests_share_draft_graphs_and_survive_collections(gpu_engine):
    """The draft passes' graphs are captured once per set, then every later speculative request reuses a set; a
    garbage collection during a capture (here forced at nearly every allocation, with dead graphs about) must
    not reset a dead graph mid-capture, which fails the capture (the 500 of a seeded MTP request)."""
    import gc

    from ds4serve.engine.cuda_graphs import Captured
    from ds4serve.engine.drafts import resolve_proposer

    prompt = [0, *range(2000, 2030)]
    plain = gpu_engine.generate(prompt, SamplingParams(max_tokens=16))
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for k in (1, 2, 4, 3):
            dead = Captured(lambda: torch.ones(4, device="cuda:0") * 2, torch.device("cuda:0"))
            dead.cycle = dead  # freed only by a collection
            del dead
            res = gpu_engine.generate(prompt, SamplingParams(max_tokens=16), speculative=f"mtp:{k}")
            assert res.ok, res.error_message
            assert res.stats.speculative["drafted"] > 0
    finally:
        gc.set_threshold(*threshold)
    assert plain.ok and len(res.tokens) == len(plain.tokens)
    first = resolve_proposer(gpu_engine, "mtp")
    first.end()
    assert resolve_proposer(gpu_engine, "mtp:2").passes is first.passes  # every request released its set


def test_speculative_requests_side_by_side_give_what_each_gives_alone(gpu_engine):
    """Four MTP requests at once (greedy and seeded), each holding a set of draft passes and verifying in graphs
    over its own state, those graphs sharing one memory pool: each gets, token for token, what it gets alone."""
    prompts = [[0, *range(3000 + 50 * i, 3020 + 53 * i)] for i in range(4)]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8 if i % 2 else 0.0, seed=11 + i if i % 2 else None)
        for i in range(4)
    ]
    alone = [gpu_engine.generate(p, q, speculative="mtp") for p, q in zip(prompts, params)]
    handles = [gpu_engine.stream(p, q, speculative="mtp") for p, q in zip(prompts, params)]
    while not all(h.done for h in handles):
        gpu_engine.step()
    for one, handle in zip(alone, handles):
        assert one.ok and handle.result.ok, handle.result.error_message
        assert handle.result.tokens == one.tokens
        assert handle.result.stats.speculative["drafted"] > 0
