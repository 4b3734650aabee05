"""Engine.prompt_scores (the legacy ``echo`` logprobs): the prompt scored in the engine's chunks, each chunk under
the engine's lock alone, and a scoring that can be cancelled between chunks."""

from __future__ import annotations

import threading

import pytest
import torch

from ds4serve import Engine
from ds4serve.engine import ErrorCode, GenerateError
from ds4serve.engine.step_loop import even_chunks

CHUNK = 8


@pytest.fixture(scope="module")
def chunked(tiny_dir):
    return Engine.from_pretrained(tiny_dir, chunk_size=CHUNK)


PROMPT = [0] + [(7 * i) % 200 + 3 for i in range(1, 29)]  # 29 tokens: four chunks of the engine's size


def test_scores_are_the_chunked_prefills_logprobs_and_top(chunked):
    """Each token's log-probability and the top 5 at its position are those of the logits the same chunks give,
    bit for bit, over a prompt of several chunks."""
    top = 5
    scores = chunked.prompt_scores(PROMPT, top)
    logits = chunked.score(PROMPT, chunk_sizes=even_chunks(len(PROMPT), CHUNK))
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1]
    values, ids = lp.topk(top, dim=-1)
    assert len(scores.logprobs) == len(PROMPT) - 1
    assert scores.logprobs == lp.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    assert scores.top_ids == ids.tolist() and scores.top_logprobs == values.tolist()
    assert chunked.prompt_scores(PROMPT, 0).top_ids == [[]] * (len(PROMPT) - 1)
    assert chunked.prompt_scores(PROMPT[:1], 3).logprobs == []


class _Recorder:
    """The engine's lock, recording each hold and each chunk forwarded inside one."""

    def __init__(self, lock: threading.RLock, events: list[str]):
        self.lock, self.events = lock, events

    def __enter__(self):
        self.lock.acquire()
        self.events.append("hold")

    def __exit__(self, *exc):
        self.events.append("free")
        self.lock.release()


def test_the_lock_is_held_one_chunk_at_a_time(chunked, monkeypatch):
    """Between two chunks the lock is free, so the step loop (which takes it for a step) goes on while a long
    prompt is scored."""
    events: list[str] = []
    monkeypatch.setattr(chunked, "_lock", _Recorder(chunked._lock, events))
    forward = chunked.prefill
    monkeypatch.setattr(chunked, "prefill", lambda *a, **kw: events.append("chunk") or forward(*a, **kw))
    chunked.prompt_scores(PROMPT, 2)
    chunks = len(even_chunks(len(PROMPT), CHUNK))
    assert events == ["hold", "free"] + ["hold", "chunk", "free"] * chunks


def test_a_cancelled_scoring_stops_before_its_next_chunk(chunked, monkeypatch):
    cancel = threading.Event()
    calls = []
    forward = chunked.prefill

    def prefill(*a, **kw):
        calls.append(1)
        out = forward(*a, **kw)
        cancel.set()  # the client went away while the first chunk ran
        return out

    monkeypatch.setattr(chunked, "prefill", prefill)
    with pytest.raises(GenerateError) as err:
        chunked.prompt_scores(PROMPT, 2, cancel)
    assert err.value.code is ErrorCode.CANCELLED and len(calls) == 2  # the second raised before forwarding


def test_no_tokens_or_a_negative_top_are_refused(chunked):
    with pytest.raises(ValueError, match="token_ids, top"):
        chunked.prompt_scores([], 1)
    with pytest.raises(ValueError, match="token_ids, top"):
        chunked.prompt_scores([0, 1], -1)
