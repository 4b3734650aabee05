"""Clients nobody here wrote (issue 36): what the openai and anthropic SDKs, evaluation harnesses, coding
agents and browsers send, through the live server."""

from __future__ import annotations

import anthropic
import openai
import pytest
import torch

from ds4serve import Engine, SamplingParams
from ds4serve.engine.prefix_cache import PrefixCache
from ds4serve.engine.sampler import Sampler
from ds4serve.server.app import ServerConfig, create_app

from .server_harness import running

KEY = "clients-key"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(tiny_dir, max_context=256)


@pytest.fixture(scope="module")
def base(engine):
    app = create_app(engine, ServerConfig(model_name="tiny", max_tokens_limit=200), PrefixCache(64 << 20))
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)


# ---- 1: sampling from a snapshot's logits ------------------------------------------------------------


class _Elsewhere:
    """Logits on a device the sampler does not sample on: only ``.to`` reads them (as a host tensor can only
    meet a CUDA generator once moved)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.moved_to = tensor, []

    def to(self, device, *args, **kwargs):
        self.moved_to.append(torch.device(device))
        return self.tensor.to(device, *args, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_moves_logits_to_its_generators_device(temperature):
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=5, top_k=10, logit_bias={3: 1.0})
    logits = torch.randn(64)
    expected = Sampler(params, 64, "cpu").sample(logits, [1, 2], [])
    sampler = Sampler(params, 64, "cpu")
    elsewhere = _Elsewhere(logits)
    assert sampler.sample(elsewhere, [1, 2], []) == expected
    assert elsewhere.moved_to == [sampler.generator.device]


def test_a_seeded_sampled_request_on_a_fully_cached_prompt_is_the_uncached_one(oai):
    """The second request restores its whole prompt from the prefix cache and samples its first token from the
    snapshot's host copy of the logits: the same seeded tokens as the first, which prefilled it."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "fully cached, sampled"}], max_tokens=8)
    first = oai.chat.completions.create(temperature=0.8, seed=17, **kw)
    second = oai.chat.completions.create(temperature=0.8, seed=17, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    greedy = [oai.chat.completions.create(temperature=0, **kw).choices[0].message.content for _ in range(2)]
    assert greedy[0] == greedy[1]
