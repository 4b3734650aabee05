"""The sampler on hand-made logits: every transform does what the module docstring documents."""

from __future__ import annotations

import math

import pytest
import torch

from ds4serve.engine.request import SamplingParams
from ds4serve.engine.sampler import NO_TOKEN, Sampler, Stream, counter_key
from tests.helpers import random_prompt

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])


def _dist(**kw) -> torch.Tensor:
    return Sampler(SamplingParams(**kw), 5).distribution(LOGITS, prompt=[], output=[])


def test_greedy_is_argmax_after_bias():
    s = Sampler(SamplingParams(logit_bias={3: 10.0}), 5)
    assert s.sample(LOGITS, [], []) == 3
    assert Sampler(SamplingParams(), 5).sample(LOGITS, [], []) == 0


def test_temperature_one_is_softmax():
    assert torch.allclose(_dist(temperature=1.0), torch.softmax(LOGITS, -1))


def test_temperature_scales_logits():
    assert torch.allclose(_dist(temperature=0.5), torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_the_k_largest():
    d = _dist(temperature=1.0, top_k=2)
    assert torch.count_nonzero(d) == 2 and torch.allclose(d[:2], torch.softmax(LOGITS[:2], -1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS, -1)
    d = _dist(temperature=1.0, top_p=float(p[0] + 0.01))  # needs the top two
    assert torch.count_nonzero(d) == 2
    d = _dist(temperature=1.0, top_p=float(p[0] - 0.01))  # the top one suffices
    assert torch.count_nonzero(d) == 1


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    p = torch.softmax(LOGITS, -1)
    ratio = float(p[2] / p[0])
    d = _dist(temperature=1.0, min_p=ratio * 1.01)
    assert torch.count_nonzero(d) == 2
    d = _dist(temperature=1.0, min_p=ratio * 0.99)
    assert torch.count_nonzero(d) == 3


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = Sampler(SamplingParams(repetition_penalty=2.0), 5)
    out = s.adjusted(LOGITS, prompt=[0], output=[3, 3])
    assert out.tolist() == [1.0, 1.0, 0.5, -2.0, -3.0]


def test_frequency_and_presence_penalties_count_output_occurrences():
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 5)
    out = s.adjusted(LOGITS, prompt=[1, 1, 1], output=[2, 2, 4])
    assert out.tolist() == [2.0, 1.0, 0.5 - 1.0 - 0.25, -1.0, -3.0 - 0.5 - 0.25]


def test_penalty_window_limits_the_history():
    s = Sampler(SamplingParams(frequency_penalty=1.0, penalty_window=2), 5)
    out = s.adjusted(LOGITS, prompt=[], output=[0, 0, 0, 1, 2])
    assert out.tolist() == [2.0, 0.0, -0.5, -1.0, -3.0]


def _sampled(s: Sampler, n: int) -> list[int]:
    """``s.sample`` for output indexes 0 .. n-1 (no penalties: only the output's length matters)."""
    output = [0] * n
    return [s.sample(LOGITS, [], output[:i]) for i in range(n)]


def test_seeded_samplers_are_private_and_reproducible():
    a = Sampler(SamplingParams(temperature=1.0, seed=3), 5)
    b = Sampler(SamplingParams(temperature=1.0, seed=3), 5)
    other = Sampler(SamplingParams(temperature=1.0, seed=4), 5)
    draws_a = _sampled(a, 40)
    _sampled(other, 7)  # another request must not disturb b
    assert draws_a == _sampled(b, 40)
    assert draws_a != _sampled(other, 40)


def test_a_draw_depends_on_its_index_and_stream_only():
    """The number for token index 5 is the same drawn first or after indexes 0..4 of every stream."""
    probs = torch.softmax(LOGITS, -1)
    fresh, used = (Sampler(SamplingParams(temperature=1.0, seed=9), 5) for _ in range(2))
    for i in range(5):
        used.sample(LOGITS, [], [0] * i)
        for stream in Stream:
            used.draw(probs, i, stream)
            used.uniform(i, stream)
    assert used.sample(LOGITS, [], [0] * 5) == fresh.sample(LOGITS, [], [0] * 5)
    for stream in Stream:
        assert used.draw(probs, 5, stream) == fresh.draw(probs, 5, stream)
        assert used.uniform(5, stream) == fresh.uniform(5, stream)
    dist = fresh.distribution(LOGITS, [], [1, 2, 3, 4, 0])
    assert fresh.sample(LOGITS, [], [1, 2, 3, 4, 0]) == fresh.draw(dist, 5, Stream.SAMPLE)


def test_seeds_indexes_and_streams_give_different_numbers():
    """1000 indexes: each seed's and each stream's uniforms are distinct, spread over [0, 1) and unrelated to
    another seed's or stream's at the same indexes."""
    n = 1000
    a = Sampler(SamplingParams(temperature=1.0, seed=0), 5)
    b = Sampler(SamplingParams(temperature=1.0, seed=1), 5)
    rows = torch.tensor(
        [[s.uniform(i, stream) for i in range(n)] for s in (a, b) for stream in Stream], dtype=torch.float64
    )
    assert all(len(set(row.tolist())) == n for row in rows)
    assert ((rows >= 0) & (rows < 1)).all()
    assert (rows.mean(1) - 0.5).abs().max() < 0.05  # the mean of n uniforms: sd 0.009
    deciles = torch.stack([torch.histc(row, bins=10, min=0, max=1) for row in rows])
    assert deciles.min() > 60 and deciles.max() < 140  # expected 100 each, sd 9.5
    corr = torch.corrcoef(rows)
    assert (corr - torch.eye(len(rows), dtype=torch.float64)).abs().max() < 0.15  # sd ~0.03 if unrelated


def test_unseeded_requests_draw_their_own_seeds():
    a, b = (Sampler(SamplingParams(temperature=1.0), 5) for _ in range(2))
    assert a.seed != b.seed
    assert _sampled(a, 40) != _sampled(b, 40)


def test_seeds_are_taken_modulo_two_to_the_64():
    assert Sampler(SamplingParams(seed=-1), 5).seed == 2**64 - 1


def test_counter_keys_are_injective_in_each_argument():
    keys = {counter_key(7, i, Stream.SAMPLE) for i in range(5000)}
    keys |= {counter_key(s, 3, Stream.SAMPLE) for s in range(5000)}
    keys |= {counter_key(7, 3, stream) for stream in Stream}
    assert len(keys) == 5000 + 5000 - 1 + len(Stream) - 1  # (7, 3, SAMPLE) is in all three
    assert all(0 <= k < 2**64 for k in keys)


def test_sampling_frequencies_follow_the_distribution():
    s = Sampler(SamplingParams(temperature=1.0, seed=0), 5)
    counts = torch.bincount(torch.tensor(_sampled(s, 4000)), minlength=5)
    expected = torch.softmax(LOGITS, -1) * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # p = 0.001 with 4 degrees of freedom


def test_a_seeded_request_samples_the_same_tokens_from_a_restored_prompt(engine):
    """A prompt restored from a snapshot (all of it, or a prefix) gives the seeded tokens of a cold run."""
    prompt = random_prompt(40, seed=33)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    cold = engine.generate(prompt, params)
    for cached in (len(prompt), 25):
        engine.generate(prompt[:cached], SamplingParams(max_tokens=1))
        warm = engine.generate(prompt, params, snapshot=engine.snapshot())
        assert warm.stats.cached_tokens == cached
        assert warm.tokens == cold.tokens
    assert len(set(cold.tokens)) > 1


def test_logprobs_are_raw_log_softmax_with_top_n():
    s = Sampler(SamplingParams(temperature=2.0, logprobs=2, logit_bias={4: 50.0}), 5)
    entry = s.logprob(LOGITS, 1)
    lp = torch.log_softmax(LOGITS, -1)
    assert math.isclose(entry.logprob, float(lp[1]), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == [0, 1]


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", -1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("logprobs", 50),
        ("temperature", float("nan")),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
    ],
)
def test_invalid_fields_are_named(field, value):
    from ds4serve.engine.request import GenerateError

    with pytest.raises(GenerateError, match=field):
        SamplingParams(**{field: value}).validate(5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0, top_p=5e-324),  # below float32's smallest number: rounds to 0 there
        dict(temperature=5e-324),  # likewise: the logits would be divided by 0
        dict(temperature=1.0, repetition_penalty=5e-324),  # a seen positive logit divided by 0
        dict(
            temperature=1e-5, repetition_penalty=1e-36
        ),  # a seen logit over 1e-36, then over 1e-5: past float32
        dict(temperature=1.0, repetition_penalty=1e300),  # the penalty itself overflows float32
    ],
)
def test_extreme_valid_parameters_give_a_distribution(kw):
    """Values the API accepts but float32 cannot hold as they are still give a distribution to draw from, and
    the draw is a token it allows."""
    s = Sampler(SamplingParams(**kw), 5)
    d = s.distribution(LOGITS, prompt=[0, 3], output=[1])
    assert torch.isfinite(d).all() and (d >= 0).all() and math.isclose(float(d.sum()), 1.0, rel_tol=1e-6)
    assert d[s.sample(LOGITS, [0, 3], [1])] > 0


def test_top_p_below_the_top_token_keeps_only_it():
    assert _dist(temperature=1.0, top_p=5e-324).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_temperatures_below_the_epsilon_are_greedy():
    assert Sampler(SamplingParams(temperature=1e-6), 5).greedy
    assert not Sampler(SamplingParams(temperature=1e-5), 5).greedy
    assert _dist(temperature=5e-324).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("penalty", [5e-324, 1e300])
def test_ruled_out_tokens_stay_out_under_any_repetition_penalty(penalty):
    """A ``-inf`` logit (a token a grammar rules out) that is also in the history stays ``-inf`` whatever the
    penalty: a factor that float32 rounds to 0 or inf would make it NaN, which argmax would pick."""
    logits = torch.tensor([float("-inf"), 0.0, 1.0, -1.0, float("-inf")])
    s = Sampler(SamplingParams(repetition_penalty=penalty), 5)
    out = s.adjusted(logits, prompt=[0, 1, 4], output=[2])
    assert not out.isnan().any() and out[0] == out[4] == float("-inf")
    assert s.sample(logits, [0, 1, 4], [2]) in {1, 2, 3}


def test_a_device_draw_is_torch_multinomials_without_its_asserts():
    """The draw takes torch.multinomial's token from the same numbers (seeded outputs are unchanged), and a
    distribution with NaN, infinity or no mass gives NO_TOKEN on the device, where multinomial asserts
    (on a GPU, fatal to the process); reading it back raises ValueError."""
    s = Sampler(SamplingParams(temperature=0.9, seed=7), vocab_size=64)
    probs = torch.softmax(torch.randn(64, generator=torch.Generator().manual_seed(3)), -1)
    for index in range(40):
        for stream in Stream:
            s._generator.manual_seed(counter_key(s.seed, index, stream))
            want = torch.multinomial(probs, 1, generator=s._generator)
            assert torch.equal(s.draw_on_device(probs, index, stream), want)
    for bad in (
        probs.clone().index_fill_(0, torch.tensor([5]), float("nan")),
        probs.clone().index_fill_(0, torch.tensor([9]), float("inf")),
        torch.zeros(64),
    ):
        assert s.draw_on_device(bad, 0, Stream.SAMPLE).tolist() == [NO_TOKEN]
        with pytest.raises(ValueError, match="NaN or infinite"):
            s.draw(bad, 0, Stream.SAMPLE)
