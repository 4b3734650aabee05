"""The torch.distributed pipeline on 2 gloo processes (127.0.0.1): exact logits, cancellation, lost ranks.

Each test starts the ranks as spawned processes and waits for events: each rank ready, rank 0's report of its
scenario, each process's exit. Every wait is bounded, so a hang fails the test instead of blocking CI; the
bounds are generous (a loaded 2-core machine runs the ranks many times slower than an idle one), since a hang
outlasts any of them: a worker waits days for rank 0's next operation.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ds4serve import SamplingParams
from ds4serve.engine.cuda_graphs import DecodeGraph, VerifyGraph
from ds4serve.engine.prefill_graphs import FirstChunkGraphs
from ds4serve.model.batch import ROW_TILE
from tests.helpers import random_prompt

SPLIT = [2, 4]
# the ranks' data timeout (a peer silent this long is an error; a dead one is at once): generous, since the
# rendezvous and the start-up handshake wait for the slower rank to load
TIMEOUT = datetime.timedelta(seconds=120)
EVENT_S = 300  # the longest wait for one event (a rank ready or gone, rank 0's report)
RUN_S = 900  # the longest wait for rank 0's report of the exact scenario (many forwards)
PROMPT = random_prompt(45, seed=21)
CHUNKS = [5, 1, 20, 19]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BATCHED = [random_prompt(3 + 4 * i, seed=60 + i) for i in range(10)]  # prompts of requests run together
LOGPROBS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int, path: str):
    import torch.distributed as dist

    from ds4serve.parallel.worker import init_pipeline

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT
    )
    return init_pipeline(path, layer_split=SPLIT, max_context=256, timeout=TIMEOUT)


def _rank_main(rank: int, port: int, path: str, scenario: str, out: str, ready, go, done) -> None:
    """One rank: rank 0 runs ``scenario``, saves what it saw to ``out`` and reports on ``done``; the others
    serve. A rank that gets a PipelineError writes it to ``out.rank<N>.err`` and exits with 3."""
    import torch.distributed as dist

    from ds4serve.engine import Engine
    from ds4serve.parallel.pipeline import PipelineError, PipelineModel, serve_shard
    from ds4serve.tokenizer import Tokenizer

    shard, groups, table = _join(rank, port, path)
    code = 0
    try:
        if rank != 0:
            ready.put((rank, os.getpid()))
            serve_shard(shard, groups, table)
        else:
            model = PipelineModel(shard, groups, table)
            engine = Engine(model, Tokenizer(path), max_context=256)
            ready.put((rank, os.getpid()))
            go.wait(EVENT_S)
            torch.save(SCENARIOS[scenario](engine), out)
            done.put(rank)
            model.close()
    except PipelineError as exc:
        Path(out + f".rank{rank}.err").write_text(str(exc))
        code = 3
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _exact(engine) -> dict:
    model = engine.model
    out = {"score": engine.score(PROMPT, CHUNKS), "generate": engine.generate(PROMPT, GREEDY).tokens}
    snap = engine.snapshot()
    out["snapshot_layers"] = sorted(snap.layers)
    engine.restore(snap)
    cont = engine.generate(snap.tokens + [17], GREEDY)
    out["restored"], out["restored_cached"] = cont.tokens, cont.stats.cached_tokens
    seen: list[int] = []
    out["cancelled"] = engine.generate(
        PROMPT, GREEDY, on_token=lambda t: seen.append(t) or len(seen) < 2
    ).finish_reason
    out["after_cancel"] = engine.generate(PROMPT, GREEDY).tokens
    state = model.new_state(64)
    engine.prefill(state, PROMPT[:30])
    verify = model.forward(PROMPT[30:35], state, logit_rows=slice(None))
    state.commit(verify.delta, 2)
    tail = model.forward(PROMPT[35:38], state, logit_rows=slice(None))
    out["verify"], out["tail"], out["tail_hidden"] = verify.logits, tail.logits, tail.hidden
    out["nbytes"] = model.nbytes()
    out["paused"] = _paused(engine, model.new_state(64))
    state = model.new_state(64)
    out["graph_steps"] = _graph_steps(engine, state, model.decode_graph(state, graph=False))
    state = model.new_state(64)
    out["verify_graph_steps"] = _verify_graph_steps(engine, state, model.verify_graph(state, 4, graph=False))
    out["speculative_graphs"] = _speculative_through_graphs(engine, out["generate"])
    out["first_chunks"] = _first_chunk_steps(engine, model.first_chunks(96, graph=False))
    out["together"] = _together(engine)
    return out


def _together(engine) -> dict:
    """``BATCHED`` requests, each alone and then all submitted at once: their tokens and logprobs both ways,
    and the most rows a decode step took together (over 8: the step ran as two micro-batches)."""
    alone = [_tokens_and_logprobs(engine.generate(p, LOGPROBS)) for p in BATCHED]
    handles = [engine.stream(p, LOGPROBS) for p in BATCHED]
    rows = 0
    while not all(h.done for h in handles):
        rows = max(rows, engine.step().decode_rows)
    return {"rows": rows, "alone": alone, "together": [_tokens_and_logprobs(h.result) for h in handles]}


def _tokens_and_logprobs(result) -> tuple[list[int], list[tuple]]:
    """A result's tokens and logprobs as plain values (what torch.load reads back)."""
    return result.tokens, [dataclasses.astuple(lp) for lp in result.logprobs]


def _paused(engine, state) -> torch.Tensor:
    """A 40-token prefill whose one chunk's commit pauses at 13 and 27 to snapshot (as at cache points): its
    logits, then every layer's window in each snapshot."""
    paused: list = []
    logits = engine.prefill(
        state, PROMPT[:40], pauses=(13, 27), at_pause=lambda s: paused.append(s.snapshot())
    )
    windows = [snap.layers[layer]["window"].flatten() for snap in paused for layer in sorted(snap.layers)]
    return torch.cat([logits.flatten(), *windows])


def _speculative_through_graphs(engine, plain: list[int]) -> dict:
    """Greedy speculative decoding with the engine's graphs for the pipeline (uncaptured on CPU, where the
    engine would otherwise run eagerly): the decode and verify graphs of every rank, plain's tokens."""
    from ds4serve.engine.drafts import OracleProposer

    engine._graph_kinds = lambda model: (
        lambda m, s: m.decode_graph(s, graph=False),
        lambda m, s, width, capture: m.verify_graph(s, width, capture, graph=False),
    )
    res = engine.generate(PROMPT, GREEDY, speculative=OracleProposer(PROMPT + plain, 0.7, 4))
    del engine._graph_kinds
    return {
        "tokens": res.tokens,
        "drafted": res.stats.speculative["drafted"],
        "graphs": sorted({type(g).__name__ for g in engine._verify_graphs.values()}),
    }


def _graph_steps(engine, state, graph) -> torch.Tensor:
    """Logits of 8 greedy decode steps through ``graph`` (uncaptured on CPU) after a 30-token prefill."""
    logits = engine.prefill(state, PROMPT[:30])
    steps = []
    for _ in range(8):
        logits = graph.step(int(logits.argmax())).logits[0].clone()
        steps.append(logits)
    assert state.pos == 38
    return torch.stack(steps)


def _verify_graph_steps(engine, state, graph) -> torch.Tensor:
    """Logits of two verify blocks of width 4 through ``graph`` (uncaptured on CPU), 2 then 3 rows
    committed by the graph, then of one eager decode step over the committed state."""
    engine.prefill(state, PROMPT[:30])
    first = graph.run(PROMPT[30:34]).logits.clone()
    graph.commit(PROMPT[30:32])
    second = graph.run(PROMPT[32:36]).logits.clone()
    graph.commit(PROMPT[32:35])
    assert state.pos == 35 and state.tokens[-5:] == PROMPT[30:35]
    after = engine.model.forward([PROMPT[35]], state, logit_rows=slice(None)).logits
    return torch.cat([first, second, after])


def _first_chunk_steps(engine, graphs) -> torch.Tensor:
    """Logits of two prompts (30 and 20 tokens: one bucket of 64, its buffers reused) through the engine with
    ``graphs`` as its first-chunk graphs (uncaptured on CPU; every bucket run once first, as a warm-up does),
    each followed by an eager 3-token chunk over the state the padded chunk committed."""
    engine._prefill_graphs = lambda: graphs
    assert graphs.capture_all() == 2 and graphs.capture_all() == 0  # buckets 64 and 96, each once
    rows = []
    try:
        for n in (30, 20):
            state = engine.model.new_state(64)
            rows.append(engine.prefill(state, PROMPT[:n])[None].clone())
            assert state.pos == n and state.tokens == PROMPT[:n]
            rows.append(engine.model.forward(PROMPT[n : n + 3], state, logit_rows=slice(None)).logits)
    finally:
        del engine._prefill_graphs
    return torch.cat(rows)


def _after_peer_loss(engine) -> dict:
    first = engine.generate(PROMPT, GREEDY)
    second = engine.generate(PROMPT, GREEDY)
    return {
        "first": (first.finish_reason, first.error_message),
        "second": (second.finish_reason, second.error_message),
    }


SCENARIOS = {"exact": _exact, "peer_loss": _after_peer_loss, "idle": lambda engine: {}}


class Ranks:
    """The two spawned ranks of one test and the events they report; leaving its ``with`` kills any rank
    still running."""

    def __init__(self, tmp_path: Path, path: Path, scenario: str):
        ctx = mp.get_context("spawn")
        ready, self.go, self.done = ctx.Queue(), ctx.Event(), ctx.Queue()
        self.out = str(tmp_path / "result.pt")
        args = (_free_port(), str(path), scenario, self.out, ready, self.go, self.done)
        self.procs = [ctx.Process(target=_rank_main, args=(r, *args)) for r in range(2)]
        for p in self.procs:
            p.start()
        try:
            self.pids = dict(self._get(ready, EVENT_S, "ready", self.procs) for _ in self.procs)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def report(self, timeout: float = EVENT_S) -> dict:
        """Rank 0's saved result, once it reports it: the test fails if rank 0 exits first or reports nothing
        within ``timeout`` (a hang)."""
        self._get(self.done, timeout, "its report", self.procs[:1])
        return torch.load(self.out)

    def gone(self, rank: int) -> int:
        """Wait for ``rank``'s process to exit; its exit code."""
        proc = self.procs[rank]
        proc.join(EVENT_S)
        assert not proc.is_alive(), f"rank {rank} is still running after {EVENT_S} s"
        return proc.exitcode

    def stop(self) -> None:
        """Kill any rank still running."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()

    @staticmethod
    def _get(box, timeout: float, what: str, senders: list) -> object:
        """The next item of ``box`` (a queue that the ranks ``senders``, from rank 0 on, put to), waiting
        while they run, at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return box.get(timeout=1)
            except queue.Empty:
                dead = {rank: p.exitcode for rank, p in enumerate(senders) if not p.is_alive()}
                if dead and box.empty():
                    pytest.fail(f"waiting for {what}: rank(s) exited first (exit codes {dead})")
                if time.monotonic() > deadline:
                    pytest.fail(f"waiting for {what}: nothing within {timeout} s (a hang)")


@pytest.fixture(scope="module")
def reference(tiny_dir, engine) -> dict:
    """The single device's results, computed with one intra-op thread as the ranks run (``_join``): the CPU's
    products are then summed in the same order, so the comparisons can be bit for bit on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(engine)
    finally:
        torch.set_num_threads(threads)


def _reference(engine) -> dict:
    out = {"score": engine.score(PROMPT, CHUNKS), "generate": engine.generate(PROMPT, GREEDY).tokens}
    snap = engine.snapshot()
    engine.restore(snap)
    cont = engine.generate(snap.tokens + [17], GREEDY)
    out["restored"], out["restored_cached"] = cont.tokens, cont.stats.cached_tokens
    state = engine.new_sequence(64)
    engine.prefill(state, PROMPT[:30])
    verify = engine.model.forward(PROMPT[30:35], state, logit_rows=slice(None))
    state.commit(verify.delta, 2)
    tail = engine.model.forward(PROMPT[35:38], state, logit_rows=slice(None))
    out["verify"], out["tail"], out["tail_hidden"] = verify.logits, tail.logits, tail.hidden
    out["nbytes"] = engine.model.nbytes()
    out["paused"] = _paused(engine, engine.new_sequence(64))
    state = engine.new_sequence(64)
    out["graph_steps"] = _graph_steps(engine, state, DecodeGraph(engine.model, state, graph=False))
    state = engine.new_sequence(64)
    out["verify_graph_steps"] = _verify_graph_steps(
        engine, state, VerifyGraph(engine.model, state, 4, graph=False)
    )
    out["first_chunks"] = _first_chunk_steps(engine, FirstChunkGraphs(engine.model, 96, graph=False))
    out["alone"] = [engine.generate(p, LOGPROBS).tokens for p in BATCHED]
    return out


@pytest.mark.timeout(3 * EVENT_S + RUN_S)
def test_two_gloo_ranks_equal_single_device(tmp_path, tiny_dir, reference):
    with Ranks(tmp_path, tiny_dir, "exact") as ranks:
        ranks.go.set()
        got = ranks.report(RUN_S)
        assert [ranks.gone(0), ranks.gone(1)] == [0, 0]  # rank 0 closed the pipeline, the worker returned
    for key in (
        "score",
        "verify",
        "tail",
        "tail_hidden",
        "graph_steps",
        "verify_graph_steps",  # graphs: one per rank
        "first_chunks",
        "paused",  # every rank's layers snapshotted inside a chunk
    ):
        assert torch.equal(got[key], reference[key]), key
    assert got["generate"] == reference["generate"]
    assert got["restored"] == reference["restored"] and got["restored_cached"] == reference["restored_cached"]
    assert got["snapshot_layers"] == list(range(6))
    assert got["cancelled"] == "cancelled" and got["after_cancel"] == reference["generate"]
    assert got["nbytes"] == reference["nbytes"]
    spec = got["speculative_graphs"]
    assert spec["tokens"] == reference["generate"] and spec["drafted"] > 0
    assert spec["graphs"] == ["PipelineVerifyGraph"]
    # requests run together over the ranks, in two micro-batches: each bitwise what it gets alone there, and
    # the single device's tokens
    batched = got["together"]
    assert batched["rows"] > ROW_TILE
    assert batched["together"] == batched["alone"]
    assert [tokens for tokens, _ in batched["together"]] == reference["alone"]


@pytest.mark.timeout(5 * EVENT_S)
def test_killed_worker_gives_an_error_not_a_hang(tmp_path, tiny_dir):
    """Rank 1 is killed before rank 0's first request: both requests come back as errors (the first naming
    rank 1, the second at once: the pipeline is down), and rank 0 exits normally."""
    with Ranks(tmp_path, tiny_dir, "peer_loss") as ranks:
        os.kill(ranks.pids[1], signal.SIGKILL)
        assert ranks.gone(1) == -signal.SIGKILL
        ranks.go.set()
        got = ranks.report()
        assert ranks.gone(0) == 0  # rank 0 survived: the failure came back as a result
    reason, message = got["first"]
    assert reason == "error" and "rank 1" in message
    assert got["second"][0] == "error" and "pipeline is down" in got["second"][1]


@pytest.mark.timeout(4 * EVENT_S)
def test_worker_exits_with_an_error_when_rank0_dies(tmp_path, tiny_dir):
    with Ranks(tmp_path, tiny_dir, "idle") as ranks:
        os.kill(ranks.pids[0], signal.SIGKILL)
        assert ranks.gone(1) == 3
    assert "rank 0" in Path(ranks.out + ".rank1.err").read_text()


@pytest.mark.timeout(EVENT_S)
def test_torchrun_launcher_generates_the_single_device_tokens(tiny_dir, reference):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "ds4serve.parallel.worker",
        "--model",
        str(tiny_dir),
        "--layer-split",
        "3,3",
        "--max-context",
        "256",
        "--timeout-s",
        str(int(TIMEOUT.total_seconds())),
        "--max-tokens",
        str(GREEDY.max_tokens),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=EVENT_S - 30, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"tokens: {','.join(map(str, reference['generate']))}" in run.stdout
