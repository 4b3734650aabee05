"""The commit kernel (kernels/commit.py) writes what the torch ``write_token`` writes, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import commit  # noqa: E402
from ds4serve.state import ChunkDelta, CompressorDelta, LayerDelta, SequenceState  # noqa: E402
from ds4serve.tiny import TinySpec, tiny_config  # noqa: E402
from tests.helpers import static_decode_setup, static_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(state: SequenceState) -> dict[str, torch.Tensor]:
    out = {}
    for idx, ls in state.layers.items():
        out[f"{idx}.window"] = ls.window
        for name, c in (("compressor", ls.compressor), ("indexer", ls.indexer)):
            if c is not None:
                for field in ("buf_kv", "buf_gate", "ov_kv", "ov_gate", "entries"):
                    if getattr(c, field) is not None:
                        out[f"{idx}.{name}.{field}"] = getattr(c, field)
    return out


def _assert_same(a: SequenceState, b: SequenceState, where: str) -> None:
    ta, tb = _tensors(a), _tensors(b)
    for name, t in ta.items():  # whole buffers, rows past the committed ones included; bits, not values
        assert torch.equal(t.view(torch.uint8), tb[name].view(torch.uint8)), f"{where}: {name}"


def _at(pos: int) -> torch.Tensor:
    return torch.tensor([pos], device=DEVICE)


def _write_both(
    reference: SequenceState, state: SequenceState, delta: ChunkDelta, pos: int, token: int
) -> None:
    """The torch ``write_token`` on ``reference``, the kernel's on ``state``."""
    where = _at(pos)
    with kernels.disabled():
        reference.write_token(delta, where)
    with kernels.on_any_device():
        state.write_token(delta, where)
    reference.advance(token)
    state.advance(token)


def test_kernel_commit_of_static_steps_equals_torch_commit(tiny_factory):
    """Static steps of the tiny model from position 2 to 25: CSA windows (rate 4, overlap) and HCA
    windows (rate 8) close, the first ones included, and the ring (window 8) wraps. One forward per
    step gives both states its delta, since they are equal before it."""
    if torch.cuda.is_available():
        pytest.skip("runs the kernel in Triton's interpreter on CPU; bench/check_gpu.py covers the GPU")
    model, ids, (reference, state) = static_decode_setup(
        tiny_factory, seed=4, prompt_seed=9, length=26, prefilled=2, capacity=32
    )
    with torch.inference_mode():
        for t in ids[2:]:
            pos = reference.pos
            out, _ = static_step(model, reference, t)
            _write_both(reference, state, out.delta, pos, t)
            _assert_same(reference, state, f"position {pos}")
    assert state.pos == 26 and state._commit is not None  # the kernel committed, not the torch code


def _random_delta(state: SequenceState, g: torch.Generator, pos: int) -> ChunkDelta:
    def rand(like: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.randn(rows, like.shape[1], generator=g).to(like.device, like.dtype)

    layers = {}
    for idx, ls in state.layers.items():
        ld = LayerDelta(window_rows=rand(ls.window, 1))
        for name in ("compressor", "indexer"):
            c = getattr(ls, name)
            if c is not None:
                setattr(
                    ld,
                    name,
                    CompressorDelta(
                        rand(c.buf_kv, c.rate), rand(c.buf_gate, c.rate), rand(c.entries, 1), pos // c.rate
                    ),
                )
        layers[idx] = ld
    return ChunkDelta(start=pos, tokens=[0], layers=layers)


def _bf16_states() -> tuple[SequenceState, SequenceState]:
    cfg = tiny_config(TinySpec(window=8, hca_rate=16))  # 16 rows: two programs per HCA buffer
    return tuple(
        SequenceState.allocate(cfg, range(cfg.num_layers), 40, torch.bfloat16, DEVICE) for _ in range(2)
    )


def test_kernel_commit_of_bf16_rows_at_every_position():
    """bf16 state and random deltas, positions 0 to 23 (CSA windows close, the first HCA window at 15):
    the rows are copied as raw words."""
    reference, state = _bf16_states()
    g = torch.Generator().manual_seed(0)
    for pos in range(24):
        delta = _random_delta(reference, g, pos)
        _write_both(reference, state, delta, pos, 0)
        _assert_same(reference, state, f"position {pos}")
    assert state._commit is not None


def test_unaligned_rows_and_the_torch_reference_fall_back_to_torch(monkeypatch):
    """A bf16 row at an odd element offset is not whole words: the torch code commits it; with the
    kernels disabled the kernel is not used at all."""
    launches = []
    real = commit._launch
    monkeypatch.setattr(commit, "_launch", lambda *a: launches.append(a) or real(*a))
    reference, state = _bf16_states()
    g = torch.Generator().manual_seed(1)
    delta = _random_delta(reference, g, 3)
    rows = delta.layers[0].window_rows
    shifted = torch.empty(1, rows.shape[1] + 1, dtype=rows.dtype, device=DEVICE)
    shifted[:, 1:] = rows
    delta.layers[0].window_rows = shifted[:, 1:]
    assert commit.CommitPlan.build(state, delta) is None
    _write_both(reference, state, delta, 3, 0)
    _assert_same(reference, state, "unaligned")
    assert not launches
    with kernels.on_any_device(), kernels.disabled():
        state.write_token(_random_delta(state, g, 4), _at(4))
    assert not launches


def test_plan_is_reused_and_a_capture_fills_its_reserved_table_afterwards(monkeypatch):
    """The same delta reuses the uploaded table; a launch captured in a CUDA graph reads the table
    reserved before the capture (not one allocated from the graph's pool during it), which
    :meth:`finish_capture` fills (capture simulated: nothing runs)."""
    state = _bf16_states()[0]
    delta = _random_delta(state, torch.Generator().manual_seed(2), 0)
    with kernels.on_any_device():
        state.write_token(delta, _at(0))
        plan = state._commit
        state.write_token(delta, _at(0))
        assert state._commit is plan
        launched = []
        monkeypatch.setattr(commit, "_launch", lambda jobs, pos, split: launched.append(jobs))
        monkeypatch.setattr(commit, "_capturing", lambda t: True)
        with pytest.raises(RuntimeError, match="reserved before the capture"):
            state.write_token(_random_delta(state, torch.Generator().manual_seed(3), 0), _at(0))
        reserved = state.prepare_capture(_at(0))
        state.write_token(_random_delta(state, torch.Generator().manual_seed(3), 0), _at(0))
    assert (
        state._commit is not plan and launched[-1] is reserved
    )  # after the warm-up launch of prepare_capture
    reserved.zero_()
    state.finish_capture()
    assert torch.equal(reserved.cpu(), state._commit.host)


def test_prepare_capture_writes_nothing():
    reference, state = _bf16_states()
    with kernels.on_any_device():
        state.prepare_capture(_at(5))
    _assert_same(reference, state, "after prepare_capture")
