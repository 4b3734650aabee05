"""Exactness of the verification rule on synthetic distributions (a chi-square test of sampling
losslessness), the width policy and the n-gram lookup."""

from __future__ import annotations

import torch

from ds4serve.engine import SamplingParams
from ds4serve.engine.drafts import NgramProposer
from ds4serve.engine.sampler import Sampler, Stream
from ds4serve.engine.speculative import Draft, DraftProposer, WidthPolicy, confident_prefix, verify_token

V = 4
TRIALS = 6000
ALPHA = 1e-3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic and its p-value (chi-square survival via the regularised gamma)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = probs.numel() - 1
    return stat, float(
        torch.special.gammaincc(
            torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


def _dists(seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V + 1, V, generator=g, dtype=torch.float64) * sharp, dim=-1).float()


def test_two_draft_chain_samples_the_target_joint_distribution():
    """Target p(x1) p(x2|x1); a biased draft q(x1) q(x2|x1); tokens from two verified positions."""
    p = _dists(1, 1.0)  # p[0] = p(x1); p[1 + a] = p(x2 | x1 = a)
    q = _dists(2, 2.0)  # a different, sharper draft
    sampler = Sampler(SamplingParams(temperature=1.0, seed=123), V)
    counts = torch.zeros(V, V)
    for trial in range(TRIALS):  # output indexes 2 * trial and 2 * trial + 1, as the decode loop numbers them
        i = 2 * trial
        d1 = sampler.draw(q[0], i, Stream.DRAFT)
        d2 = sampler.draw(q[1 + d1], i + 1, Stream.DRAFT)
        x1, ok = verify_token(p[0], d1, q[0], sampler, i)
        if ok:
            x2, _ = verify_token(p[1 + x1], d2, q[1 + d1], sampler, i + 1)
        else:  # a rejection ends the step; the next token comes from the next forward
            x2 = sampler.draw(p[1 + x1], i + 1, Stream.SAMPLE)
        counts[x1, x2] += 1
    target = (p[0].unsqueeze(1) * p[1:]).flatten()
    _, p_value = _chi2(counts.flatten(), target)
    assert p_value > ALPHA
    drafted = (q[0].unsqueeze(1) * q[1:]).flatten()
    power, _ = _chi2(drafted * TRIALS, target)  # what accepting every draft would score
    assert power > 20 * V * V


def test_deterministic_draft_of_an_unlikely_token_keeps_the_target_distribution():
    p = _dists(3, 1.0)[0]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7), V)
    unlikely = int(p.argmin())
    counts = torch.zeros(V)
    for i in range(TRIALS):
        counts[verify_token(p, unlikely, None, sampler, i)[0]] += 1
    assert _chi2(counts, p)[1] > ALPHA


def test_one_hot_target_accepts_exactly_its_argmax():
    sampler = Sampler(SamplingParams(seed=0), V)
    p = torch.nn.functional.one_hot(torch.tensor(3), V).float()
    q = torch.full((V,), 1.0 / V)
    assert verify_token(p, 3, q, sampler, 0) == (3, True)
    assert verify_token(p, 1, q, sampler, 1) == (3, False)
    assert verify_token(p, 1, None, sampler, 2) == (3, False)


def test_a_verify_decision_depends_on_its_index_only():
    """The same draft checked at the same index gives the same token, whatever was verified before; over many
    indexes both outcomes occur."""
    p, q = _dists(4, 1.0)[0], _dists(5, 2.0)[0]
    draft = int((q / p).argmax())  # q > p there: accepted with probability p/q < 1
    fresh, used = (Sampler(SamplingParams(temperature=1.0, seed=3), V) for _ in range(2))
    for i in range(50):
        verify_token(p, draft, q, used, i)
    outcomes = [verify_token(p, draft, q, fresh, i) for i in range(50, 250)]
    assert outcomes == [verify_token(p, draft, q, used, i) for i in range(50, 250)]
    assert {ok for _, ok in outcomes} == {True, False}


class _Fixed(DraftProposer):
    def propose(self, history, k, sampler, index):
        return Draft([1] * k)


def test_confidence_thresholds_set_the_verify_width():
    thresholds = (0.40, 0.30)
    assert confident_prefix([0.9, 0.5, 0.7, 0.9], thresholds) == 3  # 0.45 >= 0.40, 0.315 >= 0.30
    assert confident_prefix([0.9, 0.5, 0.6, 0.9], thresholds) == 2  # 0.27 < 0.30
    assert confident_prefix([0.9, 0.4, 0.9, 0.9], thresholds) == 1  # 0.36 < 0.40
    assert confident_prefix([0.99] * 5, (0.5, 0.5, 0.5)) == 4
    prop = _Fixed(5)
    prop.confidence_scheduled = True
    policy = WidthPolicy(prop)
    assert policy.budget(10) == 5 and policy.budget(2) == 2
    assert policy.verify_count(Draft([1] * 5, confidence=[0.9, 0.5, 0.7, 0.9, 0.9]), 5) == 3
    assert policy.verify_count(Draft([1] * 5, confidence=[0.9, 0.5, 0.7, 0.9, 0.9]), 2) == 2


def test_acceptance_ewma_narrows_and_widens_the_budget():
    policy = WidthPolicy(_Fixed(6))
    assert policy.budget(100) == 6
    for _ in range(12):
        policy.update(0)
    assert policy.budget(100) == 1
    for _ in range(12):
        policy.update(6)
    assert policy.budget(100) == 6
    fixed = WidthPolicy(_Fixed(4, adaptive=False))
    fixed.update(0)
    assert fixed.budget(100) == 4 and fixed.budget(0) == 0


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    sampler = Sampler(SamplingParams(), 100)
    prop = NgramProposer(4, max_ngram=3)
    history = [5, 6, 7, 8, 9, 1, 2, 3, 50, 60, 2, 3]
    prop.begin(history, 100)
    assert prop.propose(history, 4, sampler, 0).tokens == [50, 60, 2, 3]  # "2 3" matched at 6-7
    history += [50, 61]
    assert prop.propose(history, 2, sampler, 0).tokens == []  # no earlier "61"
    history += [7]
    assert prop.propose(history, 2, sampler, 0).tokens == [8, 9]
    latest = [1, 2, 9, 1, 2, 8, 1, 2]
    prop.begin(latest, 100)
    assert prop.propose(latest, 2, sampler, 0).tokens == [8, 1]


def test_a_greedy_row_is_verified_by_its_chosen_token_as_the_general_rule_would(engine):
    """``verify_row`` decides a greedy target's row from its chosen token: the same token and verdict as
    ``verify_token`` over the one-hot distribution, for deterministic and sampled drafts alike."""
    from ds4serve.engine.generation import Generation
    from ds4serve.engine.request import GenerateResult
    from ds4serve.engine.speculative import verify_row

    V = engine.cfg.vocab_size
    gen = Generation(
        [1, 2],
        SamplingParams(max_tokens=8),
        GenerateResult(),
        engine.cfg,
        engine.tokenizer,
        torch.device("cpu"),
        0.0,
    )
    g = torch.Generator().manual_seed(5)
    for i in range(20):
        logits = torch.randn(V, generator=g)
        best = int(logits.argmax())
        q = torch.softmax(torch.randn(V, generator=g) * 3, dim=-1) if i % 2 else None
        for draft in (best, (best + 1 + i) % V):
            expected = verify_token(gen.distribution(logits), draft, q, gen.sampler, i)
            assert verify_row(gen, logits, draft, q, i) == expected == (best, draft == best)


def test_rows_are_decided_on_the_device_only_where_each_is_its_argmax(engine):
    """``Generation.argmax_decides`` holds for a plain greedy request, whose ``choose`` is each row's argmax, and
    nowhere a row's choice could depend on the tokens accepted before it."""
    from ds4serve.engine.generation import Generation
    from ds4serve.engine.request import GenerateResult

    def gen(prompt: list[int] = (1, 2), **params) -> Generation:
        return Generation(
            list(prompt),
            SamplingParams(max_tokens=8, **params),
            GenerateResult(),
            engine.cfg,
            engine.tokenizer,
            torch.device("cpu"),
            0.0,
        )

    logits = torch.randn(3, engine.cfg.vocab_size, generator=torch.Generator().manual_seed(7))
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins
    plain = gen()
    assert plain.argmax_decides(3)
    assert logits.argmax(-1).tolist() == [plain.choose(row) for row in logits]
    assert plain.choose(logits[1]) == 5
    think = engine.tokenizer.think_start_id
    assert gen([1, think], reasoning_budget=2).argmax_decides(2)
    for refused in (
        gen(temperature=0.7),
        gen(logit_bias={3: 1.0}),
        gen(repetition_penalty=1.1),
        gen(frequency_penalty=0.5),
        gen(presence_penalty=0.5),
        gen(min_tokens=2),
        gen([1, think], reasoning_budget=2),  # a third reasoning row would be forced to </think>
    ):
        assert not refused.argmax_decides(3), refused.params
