"""The lightning-indexer kernels (scores, sort-free top-k) against the torch reference, tiny sizes.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports Triton), as in tests/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import kernels  # noqa: E402
from ds4serve.kernels import ops  # noqa: E402
from ds4serve.kernels.indexer import (  # noqa: E402
    ScoresConfig,
    SelectConfig,
    index_scores,
    index_top,
    index_top_indices,
    select_top,
    select_top_indices,
)
from ds4serve.model.attention import _index_top  # noqa: E402
from ds4serve.model.rope import Rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IH, DIM, ROPE = 16, 64, 8  # dim^-0.5 and ih^-0.5 are powers of two: small integer inputs score exactly
SMALL_SELECT = SelectConfig(tile=16, split_bits=4, warps=1)  # a 40-entry row split over three programs
ONE_TILE_SELECT = SelectConfig(tile=64, warps=1)  # a 40-entry row read once, as one 64-wide tile


def _scores_ref(
    q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """The reference's math (model.attention._index_top) on already rotated queries."""
    ih, dim = q.shape[1], q.shape[2]
    scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * dim**-0.5
    scores = (scores * (head_w.float() * ih**-0.5).unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(~visible, float("-inf"))


def _lowest_index_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The documented rule: the k largest finite scores, the lowest indices first among equal ones."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)
    return chosen & (scores > float("-inf"))


def _visible(gen: torch.Generator, S: int, T: int, counts: list[int]) -> torch.Tensor:
    """``counts[s]`` visible entries at random positions of row s."""
    vis = torch.zeros(S, T, dtype=torch.bool)
    for s, n in enumerate(counts):
        vis[s, torch.randperm(T, generator=gen)[:n]] = True
    return vis.to(DEVICE)


def _inputs(gen: torch.Generator, S: int, T: int, integer: bool, dtype=torch.bfloat16):
    """``q [S,IH,DIM]``, ``keys [T,DIM]``, ``head_w [S,IH]``; ``integer``: small integers, so that
    every score is exact in any summation order and equal keys give equal (tied) scores."""
    if integer:
        q = torch.randint(-2, 3, (S, IH, DIM), generator=gen).float()
        keys = torch.randint(-2, 3, (T, DIM), generator=gen).float()
        head_w = torch.randint(-3, 4, (S, IH), generator=gen).float()
    else:
        q, keys, head_w = (
            torch.randn(S, IH, DIM, generator=gen),
            torch.randn(T, DIM, generator=gen),
            torch.randn(S, IH, generator=gen),
        )
    return q.to(DEVICE, dtype), keys.to(DEVICE, dtype), head_w.to(DEVICE, dtype)


@pytest.mark.parametrize(
    "S,dtype,config",
    [
        (1, torch.bfloat16, None),
        (3, torch.bfloat16, ScoresConfig(2, 16)),
        (3, torch.float32, ScoresConfig(1, 32)),
        (10, torch.bfloat16, None),
    ],
)
def test_scores_match_reference(S, dtype, config):
    gen = torch.Generator().manual_seed(S)
    T = 45  # not a multiple of the entry tile
    q, keys, head_w = _inputs(gen, S, T, integer=False, dtype=dtype)
    visible = _visible(gen, S, T, [[30, 0, T][s % 3] for s in range(S)])
    got = index_scores(q, keys, head_w, visible, config)
    want = _scores_ref(q, keys, head_w, visible)
    assert torch.equal(torch.isneginf(got), ~visible)
    assert torch.allclose(got[visible], want[visible], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("at", [0, 17, 44])
def test_scores_read_an_open_entry_in_its_slot(at):
    """The one-token step's open entry (row and slot) scores exactly as the buffer with the row written in
    that slot, in the first, a middle and the last (partial) entry tile; the buffer's own row there is
    never read."""
    gen = torch.Generator().manual_seed(at)
    T = 45
    q, keys, head_w = _inputs(gen, 1, T, integer=False)
    visible = _visible(gen, 1, T, [T])
    row = torch.randn(1, DIM, generator=gen).to(DEVICE, keys.dtype)
    stale = keys.clone()
    stale[at] = float("nan")
    written = keys.clone()
    written[at] = row[0]
    got = index_scores(
        q, stale, head_w, visible, ScoresConfig(1, 16), open_entry=(row, torch.tensor([at], device=DEVICE))
    )
    assert torch.equal(got, index_scores(q, written, head_w, visible, ScoresConfig(1, 16)))


@pytest.mark.parametrize("config", [SMALL_SELECT, ONE_TILE_SELECT], ids=["split", "one_tile"])
def test_select_top_counts_ties_and_masked_rows(config):
    """Rows: many ties at the k-th score (integers), fewer / exactly k finite scores, all masked,
    -0.0 tied with +0.0 at the threshold, and a visible prefix (a decode buffer) ending mid-tile;
    the row split over programs, a launch per pass, or read once as one tile."""
    gen = torch.Generator().manual_seed(7)
    T, k = 40, 6
    scores = torch.randint(0, 5, (7, T), generator=gen).float()
    scores[1, 3:] = float("-inf")  # 3 finite < k
    scores[2, k:] = float("-inf")  # exactly k finite
    scores[3] = float("-inf")
    scores[4] = torch.where(torch.arange(T) % 2 == 0, -0.0, 0.0)
    scores[4, [5, 17]] = 1.0
    scores[5, 11] = float("-inf")
    scores[5, 30:] = -torch.arange(10.0) - 1  # negatives below the zeros and integers
    scores[6, 21:] = float("-inf")
    scores = scores.to(DEVICE)
    got = select_top(scores, k, config)
    assert torch.equal(got, _lowest_index_top(scores, k))
    assert got.sum(dim=1).tolist() == [k, 3, k, 0, k, k, k]
    assert got[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 17]


@pytest.mark.parametrize("one_tile", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_select_top_radix_widths(bits, one_tile):
    """Every radix width finds the same k-th largest score, here of signed random scores."""
    gen = torch.Generator().manual_seed(bits)
    scores = torch.randn(2, 37, generator=gen).to(DEVICE)
    scores[1, ::3] = float("-inf")
    got = select_top(
        scores, 9, SelectConfig(tile=64 if one_tile else 16, bits=bits, split_bits=bits, warps=1)
    )
    assert torch.equal(got, _lowest_index_top(scores, 9))


def test_select_config_rejects_a_digit_that_does_not_divide_the_key():
    with pytest.raises(ValueError, match="bits"):
        SelectConfig(bits=3)


def _near_one(gen: torch.Generator, T: int, low: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores ``1 + low * 2**-23``: the same sign, exponent and high mantissa bits, so that the
    radix select must resolve the k-th largest in the last digits."""
    if low is None:
        low = torch.randint(0, 1 << 22, (T,), generator=gen, dtype=torch.int32)
    return (torch.full((T,), 0x3F800000, dtype=torch.int32) + low).view(torch.float32)


def _hard_rows(gen: torch.Generator, T: int, k: int) -> torch.Tensor:
    """``[11, T]`` rows that a wrong radix digit, carry or tie count would get wrong (see the comments)."""
    rows = torch.randn(11, T, generator=gen)
    rows[0] = torch.randint(0, 8, (T,), generator=gen).float()  # hundreds of exact ties at the k-th score
    rows[1] = _near_one(
        gen, T, torch.randint(0, 16, (T,), generator=gen, dtype=torch.int32)
    )  # last digit only
    digits = torch.randint(
        0, 3, (3, T), generator=gen, dtype=torch.int32
    )  # each of the three low digits 0..2
    rows[2] = _near_one(gen, T, digits[0] | (digits[1] << 8) | (digits[2] << 16))
    rows[3] = _near_one(gen, T)  # 22 random low bits: distinct keys under one long common prefix
    rows[4] = -rows[2]  # negative scores under one prefix: the key order reverses the magnitudes
    rows[5] = torch.where(
        torch.rand(T, generator=gen) < 0.5, -0.0, 0.0
    )  # the threshold is zero, of both signs
    rows[5, torch.randperm(T, generator=gen)[: k // 2]] = torch.rand(k // 2, generator=gen) + 1
    rows[5, torch.randperm(T, generator=gen)[: T // 3]] = -torch.rand(T // 3, generator=gen) - 1
    rows[6, torch.randperm(T, generator=gen)[: T // 3]] = float("-inf")  # masked entries and a padded tail
    rows[6, T - T // 5 :] = float("-inf")
    rows[6, 1] = float("inf")
    for r, finite in ((7, k), (8, k + 1), (9, k // 2), (10, 0)):  # exactly k, one more, fewer, none finite
        keep = torch.zeros(T, dtype=torch.bool)
        keep[torch.randperm(T, generator=gen)[:finite]] = True
        rows[r] = torch.randint(-2, 3, (T,), generator=gen).float().masked_fill(~keep, float("-inf"))
    return rows


@pytest.mark.parametrize(
    "T,k,config",
    [
        (
            2048,
            512,
            SelectConfig(),
        ),  # a decode row of an 8K context: one 2048-wide tile (decode rows' default)
        (1500, 512, SelectConfig()),  # one 2048-wide tile, T not a power of two
        (3001, 512, SelectConfig()),  # two programs, the last tile partial
        (9000, 512, None),  # the default for 11 rows (a prefill chunk's): three 4096-wide tiles
        (300, 37, SelectConfig(tile=64, warps=1)),  # five programs, 8-bit digit histograms summed per pass
        (300, 37, SelectConfig(tile=64, split_bits=4, warps=1)),
    ],
    ids=["one_tile_2048", "one_tile_1500", "split_3001", "split_9000", "split_bits8", "split_bits4"],
)
def test_select_top_hard_rows(T, k, config):
    """Ties at the k-th score, keys that differ only in their last digits, negative scores, -0.0
    with +0.0, -inf (masked and padding), +inf, and rows with exactly k, k+1, fewer than k and no
    finite scores: the lowest-index rule of the k largest, row by row."""
    gen = torch.Generator().manual_seed(T + k)
    scores = _hard_rows(gen, T, k).to(DEVICE)
    got = select_top(scores, k, config)
    want = _lowest_index_top(scores, k)
    for r in range(scores.shape[0]):
        assert torch.equal(got[r], want[r]), f"row {r}"
    assert got.sum(dim=1).tolist() == [k] * 9 + [k // 2, 0]


def _mask_positions(mask: torch.Tensor, k: int) -> torch.Tensor:
    """int32 ``[S, k]``: each row's True positions, ascending, then -1."""
    out = torch.full((mask.shape[0], k), -1, dtype=torch.int32)
    for r, row in enumerate(mask.cpu()):
        where = row.nonzero().flatten()
        out[r, : where.numel()] = where.to(torch.int32)
    return out


@pytest.mark.parametrize(
    "T,k,config",
    [
        (2048, 512, None),
        (3001, 512, SelectConfig()),
        (300, 37, SelectConfig(tile=128, warps=1)),  # three programs, the last tile partial
    ],
    ids=["one_tile_2048", "split_3001", "split"],
)
def test_select_top_indices_match_the_mask(T, k, config):
    """The index output of the hard rows (11 rows in one call: ties at the k-th score, shared high
    bits, +/-0, -inf padding, exactly k, fewer than k and no finite scores) lists the positions of
    :func:`select_top`'s mask, ascending, padded with -1; one tile, and split over programs."""
    gen = torch.Generator().manual_seed(T + k)
    scores = _hard_rows(gen, T, k).to(DEVICE)
    got = select_top_indices(scores, k, config)
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    want = _mask_positions(select_top(scores, k, config), k)
    for r in range(scores.shape[0]):
        assert torch.equal(got[r].cpu(), want[r]), f"row {r}"
    assert (got >= 0).sum(dim=1).tolist() == [k] * 9 + [k // 2, 0]


def test_index_top_indices_match_index_top():
    """Integer inputs with repeated keys (ties at the k-th score), visible counts above and below k
    and an all-masked row."""
    gen = torch.Generator().manual_seed(5)
    S, T, k = 3, 37, 8
    q, keys, head_w = _inputs(gen, S, T, integer=True)
    keys[20:30] = keys[10]
    visible = _visible(gen, S, T, [T, 5, 0])
    got = index_top_indices(q, keys, head_w, visible, k)
    assert torch.equal(got.cpu(), _mask_positions(index_top(q, keys, head_w, visible, k), k))
    assert (got >= 0).sum(dim=1).tolist() == [k, 5, 0]


@pytest.mark.parametrize("S,integer", [(1, True), (3, True), (3, False)])
def test_index_top_op_matches_reference(S, integer):
    """Through the custom op (``_index_top`` with the kernels on) against ``_index_top.eager``:
    visible counts above and below k, an all-masked row; integer inputs with repeated keys make
    ties at the k-th score, where the op keeps the lowest indices and torch.topk any of them."""
    gen = torch.Generator().manual_seed(20 + S)
    T, k = 37, 8
    q, keys, head_w = _inputs(gen, S, T, integer=integer)
    if integer:
        keys[20:30] = keys[10]
    visible = _visible(gen, S, T, [T, 5, 0][:S])
    turns = torch.randint(0, 4, (S, ROPE // 2), generator=gen)  # quarter turns keep integers integers
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns].to(DEVICE, q.dtype)
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns].to(DEVICE, q.dtype)
    want = _index_top.eager(q, cos, sin, keys, head_w, visible, k)
    with kernels.on_any_device():
        got = _index_top.eager(q, cos, sin, keys, head_w, visible, k)
    if not integer:
        assert torch.equal(got, want)
        return
    scores = _scores_ref(Rope.apply(q, cos, sin), keys, head_w, visible)
    assert torch.equal(got, _lowest_index_top(scores, k))

    def chosen(sel: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(~sel, float("-inf")).sort(dim=-1, descending=True).values

    assert torch.equal(chosen(got), chosen(want))  # the same scores, whichever tied entries


def test_index_top_op_traces_as_one_node():
    """The op compiles whole (fullgraph) between torch code and gives the launcher's result."""
    gen = torch.Generator().manual_seed(3)
    S, T = 1, 24
    q, keys, head_w = _inputs(gen, S, T, integer=False)
    visible = _visible(gen, S, T, [20])

    def fn(q, keys):
        return ops.index_top(q * 1, keys + 0, head_w, visible, 5)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, keys)
    assert torch.equal(got, select_top(index_scores(q, keys, head_w, visible), 5))
    assert got.sum() == 5
