"""The static one-token step (the CUDA-graph decode path) equals the eager forward, on CPU."""

from __future__ import annotations

import torch

from ds4serve.engine.cuda_graphs import delta_at
from ds4serve.engine.device_commit import DeviceCommit
from tests.helpers import static_decode_setup, static_step


def test_static_decode_matches_eager(tiny_factory):
    """Decode 40 tokens after a 30-token prompt both ways: HCA (ratio 8) and CSA windows close in
    the static path, the indexer becomes selective (top-5), and the ring wraps (window 8)."""
    model, ids, (eager, static) = static_decode_setup(
        tiny_factory, seed=2, prompt_seed=7, length=70, prefilled=30, capacity=80
    )
    with torch.inference_mode():
        for t in ids[30:]:
            ref = model.forward([t], eager, logit_rows=slice(0, 1))
            eager.commit(ref.delta, 1)
            pos = static.pos
            out, _ = static_step(model, static, t)
            static.commit(delta_at(out.delta, pos, t), 1)
            err = (out.logits - ref.logits).abs().max() / ref.logits.abs().max()
            assert err <= 1e-5, f"position {pos}: relative error {err:.3g}"
    assert static.tokens == eager.tokens


def test_device_commit_of_static_steps_equals_host_commit(tiny_factory):
    """``DeviceCommit.write_token`` + ``advance`` (the commit the decode graph captures) leaves the same committed
    state as ``commit`` of the same static deltas, across ring wraps and closing CSA/HCA windows,
    and the following static steps give the same logits."""
    model, ids, (host, device) = static_decode_setup(
        tiny_factory, seed=4, prompt_seed=9, length=60, prefilled=13, capacity=64
    )
    writes = DeviceCommit(device)
    with torch.inference_mode():
        for t in ids[13:]:
            pos = host.pos
            ref, _ = static_step(model, host, t)
            host.commit(delta_at(ref.delta, pos, t), 1)
            out, where = static_step(model, device, t)
            writes.write_token(out.delta, where)
            device.advance(t)
            assert torch.equal(out.logits, ref.logits), f"position {pos}"
    a, b = host.snapshot(), device.snapshot()
    assert a.pos == b.pos == 60 and a.tokens == b.tokens
    for layer, saved in a.layers.items():
        assert saved.keys() == b.layers[layer].keys()
        for name, tensor in saved.items():
            assert torch.equal(tensor, b.layers[layer][name]), f"layer {layer} {name}"
