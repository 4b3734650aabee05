"""GPU check of the engine lifecycle on a tiny checkpoint (run on the GPU machine).

    PYTHONPATH=. python3 bench/park_check.py

Prints, for bf16 on cuda:0: max relative logit error against the float32 CPU forward, greedy
tokens, torch.cuda.memory_allocated before/after park("target") and after unpark, and whether
generation while parked returns model_parked and after unpark reproduces the same tokens. Passes
when parking frees at least 95% of the model's weights + sequence-state bytes.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from ds4serve import Engine, ErrorCode, SamplingParams
from ds4serve.tiny import TinySpec, make_tiny


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    path = make_tiny(tempfile.mkdtemp(), TinySpec(seed=0))
    ids = torch.randint(3, 128000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = Engine.from_pretrained(path).score(ids)
    gpu = Engine.from_pretrained(path, device="cuda:0", dtype="bfloat16")
    logits = gpu.score(ids).cpu()
    rel = float((logits - ref).abs().max() / ref.abs().max())
    agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    tokens = gpu.generate(ids[:50], params).tokens
    torch.cuda.synchronize()
    owned = gpu.model.nbytes() + gpu._state.nbytes()  # weights + the sequence state park must free
    loaded = torch.cuda.memory_allocated()
    parked = gpu.park("target")
    after_park = torch.cuda.memory_allocated()
    refused = gpu.generate(ids[:50], params)
    gpu.unpark("target")
    after_unpark = torch.cuda.memory_allocated()
    again = gpu.generate(ids[:50], params).tokens
    report = {
        "bf16_vs_fp32_max_rel_err": rel,
        "bf16_vs_fp32_argmax_agreement": agree,
        "greedy_tokens": tokens,
        "weights_and_state_bytes": owned,
        "memory_allocated_loaded": loaded,
        "memory_allocated_parked": after_park,
        "memory_allocated_unparked": after_unpark,
        "parked": parked,
        "generate_while_parked": refused.error.value if refused.error else None,
        "same_tokens_after_unpark": again == tokens,
    }
    print(json.dumps(report, indent=2))
    # The rest of memory_allocated (cuBLAS workspaces, the CUDA-graph pool) is the process's, not the model's.
    ok = refused.error == ErrorCode.MODEL_PARKED and again == tokens and loaded - after_park >= 0.95 * owned
    print("PARK CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
