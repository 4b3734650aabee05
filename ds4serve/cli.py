"""``ds4serve`` command line: make-tiny, inspect, generate (serve, bench and profile register here too)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import envs, profiler

if TYPE_CHECKING:
    from .engine import Engine

Handler = Callable[[argparse.Namespace], int]
ArgsFn = Callable[[argparse.ArgumentParser], Handler]
_COMMANDS: dict[str, tuple[ArgsFn, str]] = {}


def command(name: str, help_text: str) -> Callable[[ArgsFn], ArgsFn]:
    """Register a subcommand: the decorated function adds its arguments and returns its handler."""

    def wrap(add_args: ArgsFn) -> ArgsFn:
        _COMMANDS[name] = (add_args, help_text)
        return add_args

    return wrap


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = at_least(0.0, float)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text}")
    return value


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` (int or float) no smaller than ``low``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected at least {low}, got {text}")
        return value

    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text}")
    return value


def speculative(text: str) -> str:
    """An argparse type: a speculative decoding draft, checked as the engine checks it (before the model loads)."""
    from .engine.drafts import parse_speculative
    from .engine.request import GenerateError

    try:
        parse_speculative(text)
    except GenerateError as exc:
        raise argparse.ArgumentTypeError(exc.message.removeprefix("speculative: ")) from None
    return text


# The trained checkpoint shipped as package data when it is there: bench/train_tiny.py's folder packed as one
# tar.xz (the folder is over 100 MB, mostly the zero embedding and head rows of tokens its text never used).
# Its folder's name is the served model's: a DeepSeek-V4-architecture model of 12M parameters, with MTP, trained
# on the Python standard library's sources; it writes Python-like text, it is not an assistant.
SHIPPED_MODEL = Path(__file__).resolve().parent / "default_model.tar.xz"


def default_model_dir() -> Path:
    """The built-in default model: the checkpoint folder inside :data:`SHIPPED_MODEL` (the official layout, FP8
    projections), unpacked once into the cache directory, when that archive exists; else a tiny random
    checkpoint created once there, in the transformers layout (its config names its own compression rates, so
    ``transformers.AutoTokenizer``, which reads config.json, can load the folder; the official layout's
    ratios name only the real model's)."""
    from .tiny import TinySpec, make_tiny

    if SHIPPED_MODEL.is_file():
        return unpacked(SHIPPED_MODEL, envs.get(envs.CACHE_DIR))
    path = envs.get(envs.CACHE_DIR) / "tiny-default-v2"
    if not (path / "model.safetensors.index.json").is_file():
        tmp = path.with_name(path.name + ".tmp")
        make_tiny(tmp, TinySpec(mtp=1, fmt="hf"))
        tmp.rename(path)
    return path


def default_model_note() -> str:
    """What the built-in model of :func:`default_model_dir` is, for the log."""
    if SHIPPED_MODEL.is_file():
        return (
            "a tiny DeepSeek-V4 trained on the Python standard library's sources "
            "(it continues Python code; it is not an assistant)"
        )
    return "a tiny model with RANDOM weights (its output is gibberish)"


def unpacked(archive: Path, cache: Path) -> Path:
    """The one top-level folder of the tar ``archive``, unpacked once under ``cache`` in a folder named by the
    archive's SHA-256 (a new archive unpacks anew); the folder keeps its own name (the served model's)."""
    import hashlib
    import tarfile

    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    home = cache / f"shipped-{digest}"
    if not home.is_dir():
        tmp = home.with_name(home.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tmp.rename(home)
    folders = [p for p in home.iterdir() if p.is_dir()]
    if len(folders) != 1:
        raise ValueError(f"{archive}: expected one top-level folder, found {len(folders)}")
    return folders[0]


@command("make-tiny", "write a tiny random checkpoint of the real architecture")
def _make_tiny_args(p: argparse.ArgumentParser) -> Handler:
    from .tiny import FORMATS, QUANT_MODES, TinySpec

    d = TinySpec()
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--format", choices=FORMATS, default=d.fmt)
    p.add_argument("--quantize", choices=QUANT_MODES, default=d.quantize)
    p.add_argument("--mtp", type=int, default=d.mtp, help="number of MTP next-n blocks (mtp.K.*)")
    p.add_argument("--dspark", action="store_true", help="add the three DSpark draft stages")
    p.add_argument("--window", type=int, default=d.window, help="sliding window")
    p.add_argument("--hca-rate", type=int, default=d.hca_rate)
    p.add_argument("--index-topk", type=int, default=d.index_topk)

    def run(a: argparse.Namespace) -> int:
        from .tiny import make_tiny

        spec = TinySpec(
            seed=a.seed,
            layers=a.layers,
            experts=a.experts,
            fmt=a.format,
            quantize=a.quantize,
            mtp=a.mtp,
            dspark=a.dspark,
            window=a.window,
            hca_rate=a.hca_rate,
            index_topk=a.index_topk,
        )
        out = Path(a.out_dir)
        if not out.parent.exists():
            raise ValueError(f"make-tiny: the parent directory {out.parent} does not exist")
        if out.exists() and not out.is_dir():
            raise ValueError(f"make-tiny: {out} exists and is not a directory")
        try:
            make_tiny(out, spec)
        except OSError as err:
            raise ValueError(f"make-tiny: cannot write {err.filename or out}: {err.strerror}") from None
        print(f"wrote {out}")
        return 0

    return run


STATE_CONTEXTS = (4096, 131072, 1048576)  # the contexts `inspect` gives a sequence's state size at (capped)


@command(
    "inspect",
    "print a checkpoint's config, layer pattern, parameters (total, active per token) and bytes per dtype, "
    "from the shards' headers alone",
)
def _inspect_args(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("model_dir")

    def run(a: argparse.Namespace) -> int:
        import torch

        from .state import state_nbytes
        from .weights import Checkpoint, parameter_counts

        ckpt = Checkpoint(a.model_dir)
        cfg = ckpt.cfg
        abbrev = {
            "sliding_attention": "S",
            "compressed_sparse_attention": "C",
            "heavily_compressed_attention": "H",
        }
        print(f"checkpoint   {ckpt.path} ({ckpt.layout} layout)")
        print(
            f"layers       {cfg.num_layers}: {''.join(abbrev[t] for t in cfg.layer_types)} "
            f"(S sliding, C CSA ratio {cfg.csa_rate}, H HCA ratio {cfg.hca_rate})"
        )
        print(f"hash layers  {[i for i in range(cfg.num_layers) if cfg.is_hash_layer(i)]}")
        print(
            f"dims         hidden {cfg.hidden_size}, heads {cfg.num_heads}x{cfg.head_dim} (rope {cfg.rope_dim}), "
            f"q_lora {cfg.q_lora_rank}, o {cfg.o_groups}x{cfg.o_lora_rank}, window {cfg.sliding_window}"
        )
        print(
            f"moe          {cfg.n_routed_experts} experts x {cfg.moe_inter}, top-{cfg.top_k}, "
            f"{cfg.n_shared_experts} shared"
        )
        print(f"indexer      {cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk}")
        print(f"drafts       mtp blocks {cfg.n_mtp_layers}, dspark {'yes' if cfg.dspark else 'no'}")
        fp8 = f"fp8 block {cfg.quant.fp8_block}" if cfg.quant.fp8_block is not None else "none"
        print(f"quant        {fp8}, experts {cfg.quant.expert_dtype}")
        contexts = sorted({min(n, cfg.max_position_embeddings) for n in STATE_CONTEXTS})
        sizes = [
            f"{n:,} tokens {state_nbytes(cfg, range(cfg.num_layers), n, torch.bfloat16) / 2**20:,.1f} MiB"
            for n in contexts
        ]
        print(f"state        per sequence in bf16: {'; '.join(sizes)}")
        counts = parameter_counts(ckpt)
        print(
            f"parameters   {counts.main + counts.drafts:,} = {counts.main:,} main + {counts.drafts:,} drafts; "
            f"active per token {counts.active:,} (top-{cfg.top_k} of {cfg.n_routed_experts} routed experts, "
            f"{cfg.n_shared_experts} shared, embedding and head)"
        )
        if ckpt.ignored:
            print(
                f"vision       {len(ckpt.ignored)} tensors, {counts.ignored:,} parameters, not loaded (text only)"
            )
        tensors, nbytes = Counter(), Counter()
        for st in ckpt.stored.values():
            tensors[st.dtype] += 1
            nbytes[st.dtype] += st.nbytes
        print(f"stored       {sum(nbytes.values()) / 1e6:,.1f} MB in {sum(tensors.values()):,} tensors")
        for dt in sorted(nbytes):
            print(f"  {dt:<10} {tensors[dt]:>8,} tensors {nbytes[dt] / 1e6:>12,.1f} MB")
        return 0

    return run


def engine_args(p: argparse.ArgumentParser) -> None:
    """The options that choose and place the model (``generate`` and ``serve``; see :func:`load_engine`)."""
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--devices", default=None, help="split the layers over these devices, e.g. cuda:0,cuda:1")
    p.add_argument(
        "--layer-split", default=None, help="layers per device, e.g. 22,21 (default: by free memory)"
    )
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument(
        "--max-context", type=at_least(1), default=None, help="tokens per sequence (default: the model's)"
    )
    p.add_argument(
        "--chunk-size",
        type=at_least(1),
        default=None,
        help="longest prefill chunk (default: 4096 on CUDA, 512 elsewhere)",
    )
    p.add_argument(
        "--gpu-profile", action="store_true", help="log per-phase profiler records (DS4SERVE_GPU_PROFILE)"
    )
    p.add_argument("--eager", action="store_true", help="never capture the decode step as a CUDA graph")
    p.add_argument(
        "--max-batch",
        type=at_least(1),
        default=None,
        help="sequences decoded together in one step (default: 16; on a GPU as many decode slots of "
        "--max-context tokens as --slot-memory-fraction of its free memory holds, at most 16; 1 for a "
        "layer split)",
    )
    p.add_argument(
        "--slot-memory-fraction",
        type=fraction,
        default=None,
        help="share of the GPU's free memory after loading that the default decode slots may take (default: half)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=at_least(1),
        default=None,
        help="prompt tokens forwarded per step, at least one chunk (default: the chunk size)",
    )
    p.add_argument(
        "--torch-reference",
        action="store_true",
        help="run the torch reference instead of the Triton kernels on the GPU (slow; for checking)",
    )
    p.add_argument(
        "--no-pdl", action="store_true", help="launch the kernels without programmatic dependent launch"
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="load FP8 / MXFP4 weights as dense tensors "
        "(default on GPU: kept quantized and read in place by the kernels)",
    )


def load_engine(a: argparse.Namespace) -> tuple[Engine, Path, str]:
    """The engine :func:`engine_args` ask for, its checkpoint directory and its dtype (the profiler is
    configured first, so that loading is recorded too)."""
    from .engine import Engine
    from .kernels import config as kernel_config

    profiler.configure(enabled=True if a.gpu_profile else None)
    model = Path(a.model) if a.model else default_model_dir()
    devices = a.devices.split(",") if a.devices else None
    for device in devices or [a.device]:
        _check_device(device)
    first = devices[0] if devices else a.device
    dtype = a.dtype or ("float32" if first == "cpu" else "bfloat16")
    _check_draft(model, getattr(a, "speculative", None))
    engine = Engine.from_pretrained(
        model,
        device=a.device,
        dtype=dtype,
        max_context=a.max_context,
        chunk_size=a.chunk_size,
        devices=devices,
        layer_split=_int_list("--layer-split", a.layer_split),
        quantized=False if a.dequantize else None,
        eager=a.eager,
        max_batch=a.max_batch,
        max_prefill_tokens=a.max_prefill_tokens,
        slot_memory_fraction=a.slot_memory_fraction,
        kernels=dataclasses.replace(kernel_config.current(), triton=not a.torch_reference, pdl=not a.no_pdl),
    )
    return engine, model, dtype


def _check_draft(model: Path, speculative: str | None) -> None:
    """ValueError when ``--speculative`` names a draft (mtp, dspark) that the checkpoint at ``model`` lacks or cannot
    serve: from its config and its headers, before anything loads."""
    from .engine.drafts import check_draft, parse_speculative
    from .engine.request import GenerateError
    from .weights import Checkpoint

    if speculative is None:
        return
    name, _ = parse_speculative(speculative)
    if name in ("mtp", "dspark"):
        try:
            check_draft(Checkpoint(model), name)
        except GenerateError as exc:
            raise ValueError(
                f"--speculative {speculative}: {exc.message.removeprefix('speculative: ')}"
            ) from None


def _check_device(name: str) -> None:
    """ValueError naming ``name`` when this machine has no such device (before anything loads)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"device {name!r}: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r}: CUDA is not available here (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: this machine has {count} CUDA device(s)")


@command("generate", "generate text from a prompt, streaming it to the terminal")
def _generate_args(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("prompt")
    engine_args(p)
    p.add_argument("--max-tokens", type=at_least(1), default=64)
    p.add_argument("--temperature", type=at_least(0, float), default=0.0)
    p.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=at_least(0), default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--raw",
        action="store_true",
        help="no chat template: BOS and the prompt, tokenized as /v1/completions tokenizes a text prompt",
    )
    p.add_argument(
        "--speculative",
        type=speculative,
        default=None,
        help="speculative decoding draft: mtp, dspark or ngram (NAME:K for at most K drafts per step)",
    )

    def run(a: argparse.Namespace) -> int:
        from .engine import SamplingParams
        from .tokenizer import Tokenizer

        engine, _, _ = load_engine(a)
        tok: Tokenizer = engine.tokenizer
        if a.raw:
            prompt = tok.encode_completion(a.prompt)
        else:
            prompt = tok.encode(f"{tok.decode([tok.bos_id])}<｜User｜>{a.prompt}<｜Assistant｜></think>")
        params = SamplingParams(
            max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed
        )
        printed = ""
        out: list[int] = []

        def on_token(token: int) -> None:
            nonlocal printed
            out.append(token)
            text = tok.decode(out)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text

        t0 = time.perf_counter()
        result = engine.generate(prompt, params, on_token=on_token, speculative=a.speculative)
        wall = time.perf_counter() - t0
        sys.stdout.write("\n")
        if result.error is not None:
            print(f"error: {result.error.value}: {result.error_message}", file=sys.stderr)
            return 1
        n = len(result.tokens)
        print(
            f"[{len(prompt)} prompt tokens, prefill {result.timings.prefill_tps(result.stats.prefilled_tokens):.1f} "
            f"tok/s, {n} generated, decode {result.timings.decode_tps(max(n - 1, 0)):.1f} tok/s, "
            f"finish {result.finish_reason}, {wall:.2f} s]",
            file=sys.stderr,
        )
        spec = result.stats.speculative
        if spec:
            print(
                f"[speculative {spec['method']}: {spec['steps']} verify steps, {spec['tokens_per_forward']:.2f} "
                f"tokens per target forward, acceptance {spec['acceptance_rate']:.0%}]",
                file=sys.stderr,
            )
        return 0

    return run


def _int_list(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4serve", description="Exact, fast DeepSeek-V4 serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_handler=add_args(p))
    return parser


BROKEN_PIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


def main(argv: list[str] | None = None) -> int:
    """Run one command. A ValueError (a bad option, model directory, checkpoint or environment variable: the
    message names it) is one line on stderr and exit status 2; with the log level at DEBUG, its traceback.
    Standard output closed by its reader (``ds4serve inspect ... | head``) ends the command quietly, with the
    status a Unix tool killed by SIGPIPE has."""
    try:
        logging.basicConfig(
            level=envs.get(envs.LOG_LEVEL), format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        _load_optional_commands()
        args = build_parser().parse_args(argv)
        status = args._handler(args)
        sys.stdout.flush()  # a closed pipe is found here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_STATUS
    except ValueError as exc:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"ds4serve: error: {exc}", file=sys.stderr)
        return 2


def _load_optional_commands() -> None:
    """Subcommands living in other modules register themselves on import."""
    import importlib

    for module in ("ds4serve.server.cli", "ds4serve.bench_cli", "ds4serve.profile_cli"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name not in (module, "ds4serve.server", "fastapi", "uvicorn"):
                raise


if __name__ == "__main__":
    # Run as `python -m ds4serve.cli`: delegate to the importable module so that subcommands
    # registered by other modules land in the same registry.
    from ds4serve.cli import main as _main

    raise SystemExit(_main())
