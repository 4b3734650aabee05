"""bench/train_tiny.py at toy scale: training lowers both losses, and the written checkpoint (BF16 or FP8) is what
trained, up to its storage's rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import stdlib_corpus  # noqa: E402
import train_tiny as tt  # noqa: E402

from ds4serve import kernels  # noqa: E402
from ds4serve.config import SLIDING  # noqa: E402
from ds4serve.engine import Engine  # noqa: E402
from ds4serve.model.mtp import load_mtp, mtp_forward, mtp_logits  # noqa: E402
from ds4serve.state import allocate_layer  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402
from ds4serve.weights import Checkpoint  # noqa: E402

# two sliding layers, then CSA (with a selective indexer past 16 tokens) and HCA; hash and score routing
SIZE = tt.ModelSize(
    hidden=32,
    layers=4,
    heads=2,
    head_dim=32,
    rope_dim=16,
    q_lora=32,
    o_lora=16,
    experts=4,
    top_k=2,
    moe_inter=32,
    window=16,
    hca_rate=8,
    index_heads=4,
    index_head_dim=16,
    index_topk=4,
)
SEQ = 48


@pytest.fixture(scope="module")
def trained():
    tok = Tokenizer()
    text = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 3
    stream = torch.tensor([tok.bos_id, *tok.encode(text)][: SEQ + 2])
    cfg = tt.model_config(SIZE)
    kept = tt.kept_tokens(stream, 1, (tok.bos_id, tok.eos_id))
    weights = tt.Weights(cfg, kept, seed=0, device=torch.device("cpu"))
    args = tt.TrainArgs(steps=8, batch=1, seq_len=SEQ, lr=1e-2, warmup=1, log_every=100)
    run = tt.train(weights, stream, args, torch.float32)  # one window: every step sees the same batch
    return weights, stream, run


def test_training_lowers_the_loss_and_the_mtp_loss(trained):
    _, _, run = trained
    first, last = run["history"][0], run["history"][-1]
    assert run["steps"] == 8 and run["tokens"] == 8 * SEQ
    assert last["loss"] < first["loss"] - 1.0
    assert last["mtp_loss"] < first["mtp_loss"] - 1.0


def _stored(weights: tt.Weights, ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The leaves' values as ``ckpt`` stores them (dequantized)."""
    out = {}
    for name in weights.params:
        if name.endswith(".rows"):
            out[name] = ckpt.dense(name.split(".")[0] + ".weight")[weights.kept]
        elif tt._EXPERT_PART in name:
            block, w = name.split(tt._EXPERT_PART)
            out[name] = ckpt.experts(block, w, torch.float32, "cpu")
        else:
            out[name] = ckpt.dense(name)
    return out


@pytest.mark.parametrize("quantize", ["none", "fp8"])
def test_the_written_checkpoint_scores_as_the_trained_weights(trained, tmp_path, quantize):
    weights, stream, _ = trained
    out = tt.write_trained(tmp_path / "ckpt", weights, quantize)
    ckpt = Checkpoint(out)
    assert ckpt.layout == ("transformers" if quantize == "none" else "official")
    assert ckpt.storage_format("layers.2.attn.wq_a.weight") == (None if quantize == "none" else "fp8")
    assert ckpt.storage_format("mtp.0.e_proj.weight") == (None if quantize == "none" else "fp8")
    stored = _stored(weights, ckpt)
    # the leaves moved by at most the storage's rounding (e4m3: 2^-4 of the tensor's max); then they hold it
    with torch.no_grad():
        for name, t in weights.params.items():
            assert (stored[name] - t).abs().max() <= 2**-4 * t.abs().max(), name
            t.copy_(stored[name])
    ids = stream[:SEQ]
    with kernels.disabled(), torch.no_grad():
        model, mtp = weights.build(torch.float32)
        hidden = model.forward(ids, model.new_state(SEQ)).hidden
        kept_logits = model.logits(hidden)
        engine = Engine.from_pretrained(out, eager=True)
        scored = engine.score(ids.tolist())
    kept = weights.kept
    torch.testing.assert_close(scored[:, kept], kept_logits, rtol=1e-5, atol=1e-5)
    others = torch.ones(scored.shape[1], dtype=torch.bool)
    others[kept] = False
    assert torch.count_nonzero(scored[:, others]) == 0  # tokens without rows: logit 0, as trained
    slot = torch.full((scored.shape[1],), -1, dtype=torch.long)
    slot[kept] = torch.arange(kept.numel())
    ce = tt.vocab_ce(kept_logits, stream[1 : SEQ + 1], slot, scored.shape[1])
    torch.testing.assert_close(ce, F.cross_entropy(scored, stream[1 : SEQ + 1]), rtol=1e-5, atol=1e-5)

    # the written MTP block, run as the engine's proposer runs it, gives the trained block's logits
    written = load_mtp(Checkpoint(out), 0, torch.float32, torch.device("cpu"))
    target = engine.require_model()
    nxt = stream[1 : SEQ + 1]
    with kernels.disabled(), torch.no_grad():
        outs = []
        for w, m in ((mtp, model), (written, target)):
            layer = allocate_layer(m.cfg, SLIDING, SEQ, torch.float32, m.device)
            G, _ = mtp_forward(w, hidden, nxt, m.embed[nxt], m.chunk_info(0, SEQ), layer, m.cfg, m.ropes)
            outs.append(mtp_logits(w, G, m.head, m.cfg))
    torch.testing.assert_close(outs[1][:, kept], outs[0], rtol=1e-5, atol=1e-5)


def test_the_corpus_skips_installed_packages_and_holds_out_by_name(tmp_path):
    names = [f"pkg/m{i}.py" for i in range(200)]
    held = [n for n in names if stdlib_corpus.is_heldout(n)]
    assert 0 < len(held) < 20
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text(f"x = {n!r}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "other.py").write_text("y = 1\n")
    (tmp_path / "latin.py").write_bytes("z = 'caf\xe9'\n".encode("latin-1"))
    tok = Tokenizer()
    corpus = stdlib_corpus.load_corpus(tok, root=tmp_path)
    assert corpus.meta["files"] == 200 and corpus.meta["heldout_files"] == len(held)
    assert corpus.heldout[0] == [tok.bos_id, *tok.encode(f"x = {held[0]!r}\n"), tok.eos_id]
    assert corpus.train.numel() == corpus.meta["train_tokens"]
    assert corpus.train[0].item() == tok.bos_id
