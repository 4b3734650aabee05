"""bench/serve_load.py at CPU scale: the built-in tiny model behind the real server, two concurrency levels of
~32-token prompts and 4 output tokens, the engine steps and their roofline. Structure and accounting only, no
timing."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import load_client  # noqa: E402
import serve_load  # noqa: E402

OUTPUT = 4
PROMPT = 32
PREFILL_BUDGET = 64  # prompt tokens a step: --max-prefill-tokens reaches the engine


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    out = tmp_path_factory.mktemp("load") / "load.json"
    return serve_load.parser().parse_args(
        [
            "--out", str(out), "--model", "tiny", "--device", "cpu", "--max-context", "256",
            "--concurrency", "1,2", "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT),
            "--requests-per-client", "1", "--steps", "3", "--copy-mib", "8", "--time-limit", "300",
            "--max-prefill-tokens", str(PREFILL_BUDGET),
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(args):
    return serve_load.load_engine(args)


@pytest.fixture(scope="module")
def report(engine, args):
    out: dict = {}
    serve_load.run(engine, args, out, lambda: args.out.write_text(json.dumps(out)))
    return out


def test_engine_steps_and_roofline(report, engine):
    steps = report["engine_steps"]
    assert [(s["prompt_tokens"], s["batch"]) for s in steps] == [(PROMPT, 1), (PROMPT, 2)]
    assert report["copy_gb_s"] > 0
    for s in steps:
        assert s["ms_per_step"] > 0 and s["tok_s"] > 0
        assert s["roofline_tok_s"] > 0 and s["roofline_ms"] > 0 and s["fraction_of_roofline"] > 0
        assert s["kv_bytes"] > 0
        assert s["bytes"] > s["weight_once_bytes"] + s["kv_bytes"]  # some routed experts were read
        assert s["tiled_bytes"] >= s["bytes"] and s["tiles"] == 1
        assert 1 <= s["experts_distinct_mean"] <= s["experts_bound"]
        assert s["experts_source"] == "observed"
    assert steps[0]["experts_distinct_mean"] == engine.cfg.top_k  # one row: exactly its top-k


def test_served_levels_account_for_every_request(report):
    served = report["served"]
    assert [(r["mode"], r["concurrency"]) for r in served] == [
        ("greedy", 1), ("greedy", 2), ("sampled", 1), ("sampled", 2)
    ]  # fmt: skip
    for r in served:
        assert r["requests"] == r["concurrency"]  # one a client, none cut by the time limit
        assert r["ok"] + r["errors"] + r["unfinished"] == r["requests"]
        assert r["errors"] == 0 and r["unfinished"] == 0, r["error_samples"]
        assert r["output_tokens"] == r["requests"] * OUTPUT
        assert abs(r["prompt_tokens_measured"][0] - PROMPT) <= 3
        assert r["prompt_tokens_measured"][0] <= r["prompt_tokens_measured"][1]
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] <= r["ttft_ms_max"]
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] <= r["itl_ms_max"]
        assert r["max_prefill_tokens"] == PREFILL_BUDGET
        assert r["aggregate_tok_s"] > 0 and r["engine_tok_s"] > 0 and r["roofline_tok_s"] > 0
        assert r["idle_after"]


def test_the_prefill_budget_reaches_the_engine(report, engine):
    assert engine.max_prefill_tokens == PREFILL_BUDGET


def test_a_prefill_budget_is_an_integer_of_at_least_one(engine):
    before = engine.max_prefill_tokens
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match="max_prefill_tokens"):
            engine.max_prefill_tokens = bad
    assert engine.max_prefill_tokens == before


def test_no_modes_runs_the_engine_steps_alone(engine, args):
    """``--modes ""``: the engine steps of every batch, no served level."""
    alone = serve_load.parser().parse_args(["--out", str(args.out), "--modes", "", "--concurrency", "2"])
    assert alone.modes == []
    out: dict = {}
    serve_load.run(
        engine, argparse.Namespace(**{**vars(args), "modes": [], "concurrency": [2]}), out, lambda: None
    )
    assert [s["batch"] for s in out["engine_steps"]] == [2] and out["served"] == []


def test_report_is_saved_as_json(report, args):
    assert json.loads(args.out.read_text()) == json.loads(json.dumps(report))


def test_errors_and_the_time_limit_are_counted(engine, args):
    body = serve_load.prompt_body(engine.tokenizer, PROMPT, 1)
    tags = serve_load.Tags()
    level = dict(mode="greedy", concurrency=2, requests_per_client=1, drain=60.0, seed=0)
    with serve_load.serving(engine, max_queue=4) as url:
        # longer than the context: the server refuses each, the level goes on to the end
        refused = serve_load.served_level(
            url, engine.tokenizer, body, tags, output_tokens=10_000, time_limit=300, **level
        )
        # a limit already past: no request is sent
        none = serve_load.served_level(
            url, engine.tokenizer, body, tags, output_tokens=OUTPUT, time_limit=0, **level
        )
    assert refused["requests"] == 2 and refused["errors"] == 2 and refused["ok"] == 0
    assert all(e.startswith("HTTP 400") for e in refused["error_samples"])
    assert refused["output_tokens"] == 0 and refused["ttft_ms_p50"] is None
    assert none["requests"] == 0 and none["output_tokens"] == 0
    assert tags.next == 4  # every prompt built got a number of its own


def test_summary_splits_ok_errors_and_unfinished():
    ok = load_client.RequestRecord(status=200, finished=True, ttft_s=0.5, gaps_s=[0.1, 0.3], tokens=3)
    failed = load_client.RequestRecord(status=200, finished=True, error="error event", tokens=1)
    cancelled = load_client.RequestRecord(status=200, ttft_s=0.1, gaps_s=[9.0])
    s = load_client.summarize([ok, failed, cancelled], wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"], s["unfinished"]) == (3, 1, 1, 1)
    assert s["output_tokens"] == 3 and s["aggregate_tok_s"] == 1.5
    assert s["ttft_ms_p50"] == s["ttft_ms_p99"] == 500.0
    assert (s["itl_ms_p50"], s["itl_ms_p99"]) == (100.0, 300.0)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]
    assert load_client.percentile(values, 50) == 50.0
    assert load_client.percentile(values, 99) == 99.0
    assert load_client.percentile([7.0], 99) == 7.0
    assert load_client.percentile([], 50) is None


def test_roofline_counts_experts_once_a_step_and_token_wise_weights_once_a_tile(engine):
    model = engine.require_model()
    layer, b = next(iter(model.blocks.items()))
    w = serve_load.weight_bytes(model)
    counts = serve_load.observed_counts(model, {id(b.moe): [{0, 1}, {1, 2}]})  # two tiles sharing expert 1
    assert (counts.distinct, counts.tiles) == ({layer: 3}, 2)
    roof = serve_load.step_roofline(model, counts, batch=10, kv=1000, bandwidth=1e9)
    base = w["once"] + 10 * w["embed_row"] + 1000
    assert roof["bytes"] == base + 3 * w["expert"][layer]
    assert roof["tiled_bytes"] == base + w["once"] + 3 * w["expert"][layer]
    assert roof["roofline_tok_s"] == pytest.approx(10 * 1e9 / roof["bytes"])


def test_bound_caps_experts_by_rows_and_by_the_expert_count(engine):
    model = engine.require_model()
    E, k = model.cfg.n_routed_experts, model.cfg.top_k
    one = serve_load.bound_counts(model, 1)
    assert set(one.distinct.values()) == {k} and one.tiles == 1
    many = serve_load.bound_counts(model, 20)  # tiles of 8, 8 and 4 rows
    assert many.tiles == 3
    assert set(many.distinct.values()) == {E}


def test_a_failing_observation_falls_back_to_the_bound(engine, monkeypatch):
    model = engine.require_model()

    def broken(*args, **kwargs):
        raise RuntimeError("no eager step here")

    monkeypatch.setattr(model, "decode_batch", broken)
    counts = serve_load.expert_counts(model, [object(), object()], [1, 2])
    assert counts.source == "bound" and counts.distinct == serve_load.bound_counts(model, 2).distinct
