"""``torchrun --nproc-per-node N -m ds4serve.parallel.worker --model DIR [...]``: one pipeline rank.

Every rank loads its own layer range; rank 0 also builds the :class:`~ds4serve.engine.Engine`
and answers the request given on the command line (the same engine can be handed to the HTTP
server). Ranks find each other through torch.distributed's ``env://`` rendezvous (what torchrun
sets up); across hosts run one torchrun per host with ``--nnodes``, ``--node-rank`` and
``--rdzv-endpoint``. Without ``--layer-split`` the layers are balanced by each rank's free memory.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..model import DeepSeekV4
from ..weights import Checkpoint
from .pipeline import Groups, PipelineError, PipelineModel, serve_shard, shard_handshake
from .placement import describe, free_memory, plan_split, quantized_formats

log = logging.getLogger("ds4serve.parallel")


def rank_device(kind: str, rank: int) -> torch.device:
    """``cpu``, or the CUDA device of this rank on its host (ranks are packed host by host)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"--device: expected cpu or cuda, got {kind!r}")
    return torch.device("cuda", rank % torch.cuda.device_count())


def init_pipeline(
    path: str | Path,
    *,
    device_kind: str = "cpu",
    dtype: torch.dtype = torch.float32,
    layer_split: list[int] | None = None,
    max_context: int | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=300),
    quantized: bool | None = None,
) -> tuple[DeepSeekV4, Groups, list[tuple[int, int, int]]]:
    """Join the process group (``env://`` unless already joined), place and load this rank's layers
    (``quantized``: FP8 / MXFP4 kept quantized, by default on CUDA, as the engine loads them)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", timeout=timeout)
    groups = Groups.create(timeout)
    device = rank_device(device_kind, groups.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ckpt = Checkpoint(path)
    cfg = ckpt.cfg
    context = max_context or cfg.max_position_embeddings
    quantized = device.type == "cuda" if quantized is None else quantized
    formats = quantized_formats(ckpt) if quantized else None
    free: list[int] = [0] * groups.world
    dist.all_gather_object(free, free_memory([device])[0], group=groups.objects)
    devices = [f"rank {r}" for r in range(groups.world)]
    if groups.world > cfg.num_layers:
        raise ValueError(
            f"--nproc-per-node: {groups.world} ranks but the model has only {cfg.num_layers} layers"
        )
    ranges = plan_split(
        cfg,
        [device] * groups.world,
        dtype,
        max_context=context,
        layer_split=layer_split,
        free_bytes=free,
        formats=formats,
    )
    if groups.rank == 0:
        log.info("pipeline layer split: %s", describe(cfg, devices, ranges, dtype, context, formats))
    shard = DeepSeekV4.load(ckpt, layers=ranges[groups.rank], dtype=dtype, device=device, quantized=quantized)
    return shard, groups, shard_handshake(shard, groups)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ds4serve.parallel.worker", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", required=True, help="checkpoint directory (the same path on every host)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--layer-split", default=None, help="layers per rank, e.g. 22,21")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for a peer inside a step")
    p.add_argument("--prompt-ids", default=None, help="rank 0: comma-separated token ids to generate from")
    p.add_argument("--prompt", default=None, help="rank 0: raw text to generate from")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="load FP8 / MXFP4 weights as dense tensors "
        "(default on GPU: kept quantized and read in place by the kernels)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ..engine import Engine, SamplingParams
    from ..engine.engine import resolve_dtype
    from ..tokenizer import Tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = parse_args(argv)
    split = None
    if a.layer_split:
        try:
            split = [int(x) for x in a.layer_split.split(",")]
        except ValueError:
            raise SystemExit(f"--layer-split: expected comma-separated integers, got {a.layer_split!r}")
    dtype = resolve_dtype(a.dtype or ("float32" if a.device == "cpu" else "bfloat16"))
    shard, groups, table = init_pipeline(
        a.model,
        device_kind=a.device,
        dtype=dtype,
        layer_split=split,
        max_context=a.max_context,
        timeout=datetime.timedelta(seconds=a.timeout_s),
        quantized=False if a.dequantize else None,
    )
    try:
        if groups.rank != 0:
            serve_shard(shard, groups, table)
            return 0
        model = PipelineModel(shard, groups, table)
        engine = Engine(model, Tokenizer(a.model), path=Path(a.model), max_context=a.max_context)
        try:
            if a.prompt_ids is not None:
                ids = [int(x) for x in a.prompt_ids.split(",")]
            else:
                ids = engine.tokenizer.encode(a.prompt or "Hello")
            result = engine.generate(ids, SamplingParams(max_tokens=a.max_tokens, temperature=0.0))
            if result.error is not None:
                print(f"error: {result.error.value}: {result.error_message}", file=sys.stderr)
                return 1
            print("tokens:", ",".join(map(str, result.tokens)))
            return 0
        finally:
            model.close()
    except PipelineError as exc:
        log.error("rank %d: %s", groups.rank, exc)
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
