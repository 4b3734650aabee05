"""The phase profiler and host timing: records, guards, disabled-means-free, and `ds4serve profile`.

On this CPU machine records use clock=host. The CUDA path (events, NVTX, synchronisation) runs on a
fake torch.cuda that counts every event created and every wait, so the same tests show that a
disabled profiler touches none of it and an enabled one does.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from contextlib import nullcontext

import pytest
import torch

from ds4serve import SamplingParams, cli, profiler
from ds4serve.envs import EnvError
from ds4serve.profile_cli import format_table, summarize
from tests.helpers import random_prompt

PROMPT = random_prompt(20, seed=6)
GREEDY3 = SamplingParams(max_tokens=3, ignore_eos=True)
TOP_PHASES = ("hc_pre", "attention", "hc_post", "moe_ffn", "output_projection")


@pytest.fixture(autouse=True)
def _profiler_off_afterwards(monkeypatch):
    for name in ("DS4SERVE_GPU_PROFILE", "DS4SERVE_GPU_PROFILE_FILE", "DS4SERVE_TIMING"):
        monkeypatch.delenv(name, raising=False)
    yield
    profiler.configure(enabled=False, timing=False)


class FakeCuda:
    """A counting stand-in for torch.cuda events, synchronisation and NVTX."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.counts: Counter[str] = Counter()
        self.wait_hook = lambda: None
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                fake.counts["event"] += 1
                self.t = None

            def record(self, stream=None):
                fake.counts["record"] += 1
                self.t = fake.counts["record"]

            def synchronize(self):
                fake.counts["event_sync"] += 1
                fake.wait_hook()

            def elapsed_time(self, end):
                return float(end.t - self.t)

        def synchronize(device=None):
            fake.counts["device_sync"] += 1

        def nvtx(kind):
            return lambda *args: fake.counts.update([kind])

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch.cuda.nvtx, "range_push", nvtx("nvtx_push"))
        monkeypatch.setattr(torch.cuda.nvtx, "range_pop", nvtx("nvtx_pop"))

    @property
    def touched(self) -> int:
        return sum(self.counts.values())


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def steps_of(records: list[dict]) -> list[list[dict]]:
    """Records grouped per step (each step's records start with its phase=step record)."""
    out: list[list[dict]] = []
    for r in records:
        if r["phase"] == profiler.STEP:
            out.append([])
        out[-1].append(r)
    return out


def layer_counts(cfg) -> tuple[int, int]:
    compressed = sum(t != "sliding_attention" for t in cfg.layer_types)
    csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)
    return compressed, csa


# ---- records -----------------------------------------------------------------------------------
def test_prefill_and_decode_records_carry_every_field(engine, caplog):
    profiler.configure(enabled=True)
    with caplog.at_level(logging.INFO, logger="ds4serve.profiler"), profiler.collect() as records:
        result = engine.generate(PROMPT, GREEDY3)
    assert result.ok and len(result.tokens) == 3
    for r in records:
        assert tuple(r) == profiler.RECORD_FIELDS
        assert r["clock"] == "host" and r["scope"] == "forward" and r["layers"] == "0-5"
        assert r["gpu_ms"] >= 0 and r["calls"] >= 1
    steps = steps_of(records)
    assert [(s[0]["mode"], s[0]["tokens"], s[0]["kv_start"]) for s in steps] == [
        ("prefill", 20, 0),
        ("decode", 1, 20),
        ("decode", 1, 21),
    ]
    layers = engine.cfg.num_layers
    compressed, csa = layer_counts(engine.cfg)
    calls = {r["phase"]: r["calls"] for r in steps[1]}
    assert calls == {
        "step": 1,
        "hc_pre": 2 * layers,
        "attention": layers,
        "compressor": compressed,
        "indexer": csa,
        "hc_post": layers,
        "moe_ffn": layers,
        "output_projection": 1,
    }
    lines = [m for m in caplog.messages if m.startswith("[ds4-gpu-profile]")]
    assert lines == [profiler.format_record(r) for r in records]
    assert lines[0].startswith(
        "[ds4-gpu-profile] clock=host scope=forward mode=prefill tokens=20 kv_start=0 "
        "layers=0-5 phase=step gpu_ms="
    )


def test_phase_times_nest_inside_their_step(engine):
    profiler.configure(enabled=True)
    with profiler.collect() as records:
        engine.generate(PROMPT, GREEDY3)
    for step in steps_of(records):
        ms = {r["phase"]: r["gpu_ms"] for r in step}
        assert sum(ms.get(p, 0.0) for p in TOP_PHASES) <= ms["step"]
        assert ms.get("compressor", 0.0) + ms.get("indexer", 0.0) <= ms["attention"]


def test_intermediate_prefill_chunks_have_no_output_projection(engine):
    profiler.configure(enabled=True)
    state = engine.new_sequence(len(PROMPT))
    with profiler.collect() as records, torch.inference_mode():
        engine.prefill(state, PROMPT, chunk_sizes=[8, 8, 4])
    steps = steps_of(records)
    assert [(s[0]["tokens"], s[0]["kv_start"]) for s in steps] == [(8, 0), (8, 8), (4, 16)]
    assert ["output_projection" in {r["phase"] for r in s} for s in steps] == [False, False, True]


@pytest.mark.parametrize("mode,scope", [("verify", None), ("verify", "approx_fused_verify"), ("draft", None)])
def test_verify_and_draft_steps_are_recorded_under_their_mode_and_scope(engine, mode, scope):
    profiler.configure(enabled=True)
    model = engine.model
    state = engine.new_sequence(len(PROMPT) + 4)
    with torch.inference_mode():
        engine.prefill(state, PROMPT)
        with profiler.collect() as records:
            with profiler.step(mode, 4, state.pos, model.layers, scope=scope):
                model.forward(PROMPT[:4], state, logit_rows=slice(None))
    assert {(r["mode"], r["scope"], r["tokens"], r["kv_start"]) for r in records} == {
        (mode, scope or "forward", 4, len(PROMPT))
    }
    assert {r["phase"] for r in records} >= {"step", *TOP_PHASES}


def test_a_graph_step_is_one_whole_graph_record(engine):
    profiler.configure(enabled=True)
    state = engine.new_sequence(len(PROMPT) + 1)
    with torch.inference_mode():
        engine.prefill(state, PROMPT)
        with profiler.collect() as records:
            with profiler.step("decode", 1, state.pos, engine.model.layers, graph=True):
                engine.model.forward([5], state, logit_rows=slice(0, 1))
    assert [(r["scope"], r["mode"], r["phase"], r["calls"]) for r in records] == [
        ("decode_graph", "decode", "step", 1)
    ]


def test_layer_range_names_the_shard():
    profiler.configure(enabled=True)
    with profiler.collect() as records:
        with profiler.step("decode", 1, 7, range(21, 43)):
            pass
    assert records[0]["layers"] == "21-42"


def test_json_sink_holds_the_same_records(engine, tmp_path, monkeypatch):
    sink = tmp_path / "records.jsonl"
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE", "1")
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE_FILE", str(sink))
    profiler.configure()
    with profiler.collect() as records:
        engine.generate(PROMPT, GREEDY3)
    profiler.configure(enabled=False)
    assert [json.loads(line) for line in sink.read_text().splitlines()] == records


def test_profiled_generation_gives_the_same_tokens(engine):
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))
    profiler.configure(enabled=True, timing=True)
    profiled = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))
    assert profiled.tokens == plain.tokens


# ---- guards ------------------------------------------------------------------------------------
def test_unmatched_unknown_and_stray_phases_are_ignored(caplog):
    profiler.configure(enabled=True)
    prof = profiler.active()
    with caplog.at_level(logging.DEBUG, logger="ds4serve.profiler"), profiler.collect() as records:
        assert profiler.phase("attention") is profiler.phase("hc_pre")  # outside a step: the shared no-op
        prof.end_phase("attention")
        with profiler.step("decode", 1, 0, range(0, 2)):
            assert isinstance(profiler.phase("bogus"), nullcontext)
            prof.end_phase("attention")  # not open
            prof.end_phase("step")  # the step is closed by its own scope only
            prof.begin_phase("bogus")
            prof.end_phase("bogus")
            with profiler.phase("hc_pre"):
                prof.begin_phase("hc_pre")  # already open: would overwrite its start
                prof.end_phase("moe_ffn")  # not the innermost open phase
    assert [(r["phase"], r["calls"]) for r in records] == [("step", 1), ("hc_pre", 1)]
    assert any("end_phase('attention') ignored" in m for m in caplog.messages)


def test_a_failing_step_emits_nothing_and_leaves_the_profiler_usable():
    profiler.configure(enabled=True)
    with profiler.collect() as records:
        with pytest.raises(RuntimeError):
            with profiler.step("prefill", 4, 0, range(0, 6)), profiler.phase("attention"):
                raise RuntimeError("boom")
        with profiler.step("decode", 1, 4, range(0, 6)), profiler.phase("moe_ffn"):
            pass
    assert [(r["mode"], r["phase"]) for r in records] == [("decode", "step"), ("decode", "moe_ffn")]


def test_unknown_mode_is_an_error_naming_the_field():
    profiler.configure(enabled=True)
    with pytest.raises(ValueError, match="mode: expected one of"):
        profiler.step("decoding", 1, 0, range(0, 6))


@pytest.mark.parametrize("name", ["DS4SERVE_GPU_PROFILE", "DS4SERVE_TIMING"])
def test_malformed_variable_is_a_clear_error(monkeypatch, name):
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(EnvError, match=f"{name}='sometimes'"):
        profiler.configure()


def test_cli_reports_a_malformed_variable_without_a_traceback(tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE", "2")
    assert cli.main(["generate", "--model", str(tiny_dir), "--max-tokens", "1", "hi"]) == 2
    assert "error: DS4SERVE_GPU_PROFILE='2': expected one of" in capsys.readouterr().err


def test_unwritable_sink_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="DS4SERVE_GPU_PROFILE_FILE: cannot open"):
        profiler.configure(enabled=True, file=tmp_path / "missing" / "records.jsonl")


# ---- disabled means free, and the CUDA path --------------------------------------------------
@pytest.mark.parametrize("value", [None, "0"])
def test_disabled_profiler_creates_no_events_syncs_or_output(
    engine, fake_cuda, monkeypatch, tmp_path, caplog, value
):
    if value is not None:
        monkeypatch.setenv("DS4SERVE_GPU_PROFILE", value)
    sink = tmp_path / "records.jsonl"
    monkeypatch.setenv("DS4SERVE_GPU_PROFILE_FILE", str(sink))
    profiler.configure()
    assert profiler.active() is None
    assert profiler.step("decode", 1, 0, range(0, 6)) is profiler.phase("attention")
    with caplog.at_level(logging.DEBUG), profiler.collect() as records:
        result = engine.generate(PROMPT, GREEDY3)
    assert result.ok and len(result.tokens) == 3
    assert fake_cuda.touched == 0, fake_cuda.counts
    assert records == [] and not sink.exists()
    assert not [m for m in caplog.messages if "ds4-" in m]
    assert result.stats.host_timing == {}


def test_enabled_profiler_uses_reusable_cuda_events_and_one_wait_per_step(engine, fake_cuda):
    profiler.configure(enabled=True)  # auto clock: CUDA is "initialised"
    with profiler.collect() as records:
        engine.generate(PROMPT, GREEDY3)
    created = fake_cuda.counts["event"]
    assert created > 0 and {r["clock"] for r in records} == {"cuda_event"}
    steps = steps_of(records)
    assert fake_cuda.counts["event_sync"] == len(steps)
    assert fake_cuda.counts["nvtx_push"] == fake_cuda.counts["nvtx_pop"] > 0
    assert fake_cuda.counts["device_sync"] == 0
    decode = {r["phase"]: r for r in steps[1]}
    assert decode["hc_pre"]["calls"] == 2 * engine.cfg.num_layers
    assert decode["attention"]["gpu_ms"] > 0  # elapsed between the fake events' record stamps
    engine.generate(PROMPT, GREEDY3)
    assert fake_cuda.counts["event"] == created  # the pairs made for the first request are reused


def test_profiler_waits_do_not_leak_into_host_timing(engine, fake_cuda, monkeypatch):
    """Every event wait jumps a fake clock by 1000 s: host timing must not see it, profiler_ms must."""
    jump = [0.0]
    real = profiler.perf_counter
    monkeypatch.setattr(profiler, "perf_counter", lambda: real() + jump[0])
    fake_cuda.wait_hook = lambda: jump.__setitem__(0, jump[0] + 1000.0)
    profiler.configure(enabled=True, timing=True)
    result = engine.generate(PROMPT, GREEDY3)
    timing = result.stats.host_timing
    assert fake_cuda.counts["device_sync"] == 3  # host timing's own wait, one per step, inside its timer
    assert timing["prefill"]["ms"] < 1e6 and timing["decode"]["ms"] < 1e6
    assert timing["profiler_ms"] >= 3 * 1e6


def test_capturing_stream_records_nothing(engine, fake_cuda, monkeypatch):
    profiler.configure(enabled=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert isinstance(profiler.step("decode", 1, 0, engine.model.layers), nullcontext)
    assert fake_cuda.touched == 0


# ---- host timing -------------------------------------------------------------------------------
def test_host_timing_logs_one_line_and_fills_the_stats(engine, caplog, monkeypatch):
    monkeypatch.setenv("DS4SERVE_TIMING", "1")
    profiler.configure()
    assert isinstance(profiler.phase("attention"), nullcontext)  # timing alone times no phases
    with caplog.at_level(logging.INFO, logger="ds4serve.timing"):
        result = engine.generate(PROMPT, GREEDY3)
    timing = result.stats.host_timing
    assert {k: (v["steps"], v["tokens"]) for k, v in timing.items() if k != "profiler_ms"} == {
        "prefill": (1, 20),
        "decode": (2, 2),
    }
    assert timing["decode"]["tok_s"] == pytest.approx(2 / (timing["decode"]["ms"] / 1e3))
    assert timing["profiler_ms"] == 0.0
    lines = [m for m in caplog.messages if m.startswith("[ds4-timing]")]
    assert len(lines) == 1
    assert "prompt_tokens=20 generated=3 prefill_steps=1 prefill_tokens=20 prefill_ms=" in lines[0]
    assert f"decode_ms={timing['decode']['ms']:.3f}" in lines[0]


# ---- ds4serve profile --------------------------------------------------------------------------
def test_summary_means_shares_and_other():
    base = {
        "clock": "host",
        "scope": "forward",
        "mode": "decode",
        "tokens": 1,
        "kv_start": 0,
        "layers": "0-1",
    }
    records = []
    for step_ms in (10.0, 14.0):
        records += [
            {**base, "phase": "step", "gpu_ms": step_ms, "calls": 1},
            {**base, "phase": "attention", "gpu_ms": 4.0, "calls": 2},
            {**base, "phase": "indexer", "gpu_ms": 1.0, "calls": 1},
            {**base, "phase": "moe_ffn", "gpu_ms": 5.0, "calls": 2},
        ]
    g = summarize(records)["decode/forward/0-1"]
    assert (g["steps"], g["step_ms"], g["tokens_per_step"]) == (2, 12.0, 1.0)
    assert g["phases"]["attention"] == {"ms": 4.0, "calls": 2.0, "share": pytest.approx(1 / 3)}
    assert g["phases"]["indexer"]["share"] == pytest.approx(1 / 12)
    assert g["phases"]["other"]["ms"] == pytest.approx(3.0)  # the indexer is inside attention
    table = format_table(summarize(records))
    assert "  indexer" in table and "33.3%" in table


def test_profile_command_prints_tables_and_writes_json_and_plot(tiny_dir, tmp_path, capsys):
    """With the MTP draft, the workload has prefill, verify and draft steps (the draft numbered after the target)."""
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "profile.json", tmp_path / "profile.png"
    code = cli.main(
        [
            "profile",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--prompt-tokens",
            "12",
            "--gen-tokens",
            "4",
            "--chunk-size",
            "8",
            "--warmup",
            "0",
            "--speculative",
            "mtp",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    for header in (
        "prefill  scope=forward  layers=0-5",
        "verify  scope=forward  layers=0-5",
        "draft  scope=forward  layers=6-6",
    ):
        assert header in text
    assert "moe_ffn" in text and "  compressor" in text
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["prefill/forward/0-5"]["steps"] == 2
    assert summary["verify/forward/0-5"]["steps"] >= 1 and summary["draft/forward/6-6"]["steps"] >= 1
    assert len(data["workload"]["generated"]) == 4
    assert sum(r["phase"] == "step" for r in data["records"]) == sum(g["steps"] for g in summary.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
