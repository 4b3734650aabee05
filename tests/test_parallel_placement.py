"""Placement: byte arithmetic matches what loads, splits are validated and balanced by free memory."""

from __future__ import annotations

import pytest
import torch

from ds4serve.config import ModelConfig
from ds4serve.model import DeepSeekV4
from ds4serve.parallel import plan_split, ranges_from_split, shard_bytes
from ds4serve.parallel.placement import layer_weight_bytes, quantized_formats
from ds4serve.weights import Checkpoint

GiB = 2**30


@pytest.fixture(scope="module")
def cfg(tiny_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir)


@pytest.mark.parametrize("layers", [range(0, 2), range(2, 5), range(5, 6), range(0, 6)])
def test_shard_bytes_equal_what_the_shard_holds(tiny_dir, layers):
    """The planner's arithmetic is the loaded weights plus the allocated state, to the byte."""
    shard = DeepSeekV4.load(Checkpoint(tiny_dir), layers=layers, dtype=torch.bfloat16)
    state = shard.new_state(512)
    assert shard_bytes(shard.cfg, layers, torch.bfloat16, 512) == shard.nbytes() + state.nbytes()


@pytest.mark.parametrize("quantize", ["fp8", "fp8+fp4"])
@pytest.mark.parametrize("layers", [range(0, 2), range(2, 6)])
def test_quantized_shard_bytes_equal_what_the_quantized_shard_holds(tiny_factory, quantize, layers):
    """A quantized load keeps FP8 matrices (1 byte + a float32 scale per block) and MXFP4 experts
    (half a byte + a byte per 32): the planner counts them so, to the byte."""
    ckpt = Checkpoint(tiny_factory(quantize=quantize))
    formats = quantized_formats(ckpt)
    assert "fp8" in formats.values() and ("fp4" in formats.values()) == (quantize == "fp8+fp4")
    shard = DeepSeekV4.load(ckpt, layers=layers, dtype=torch.bfloat16, quantized=True)
    state = shard.new_state(512)
    assert shard_bytes(shard.cfg, layers, torch.bfloat16, 512, formats) == shard.nbytes() + state.nbytes()
    assert (
        shard_bytes(shard.cfg, layers, torch.bfloat16, 512) > shard.nbytes() + state.nbytes()
    )  # dense counts


def test_a_quantized_load_fits_where_a_dense_one_would_not(tiny_factory):
    ckpt = Checkpoint(tiny_factory(quantize="fp8+fp4"))
    formats, everything = quantized_formats(ckpt), range(0, ckpt.cfg.num_layers)
    free = [shard_bytes(ckpt.cfg, everything, torch.bfloat16, 64, formats)]
    assert plan_split(
        ckpt.cfg, ["cpu"], torch.bfloat16, max_context=64, free_bytes=free, reserve=0, formats=formats
    ) == [everything]
    with pytest.raises(ValueError, match="devices: layers 0-5 need"):
        plan_split(ckpt.cfg, ["cpu"], torch.bfloat16, max_context=64, free_bytes=free, reserve=0)


def test_explicit_split_becomes_ranges():
    assert ranges_from_split([2, 1, 3], 6, 3) == [range(0, 2), range(2, 3), range(3, 6)]


@pytest.mark.parametrize(
    "split, devices, message",
    [
        ([3, 2], 2, "sum to the model's 6 layers"),
        ([3, 3], 3, "expected 3 counts"),
        ([6, 0], 2, "at least one layer"),
    ],
)
def test_bad_split_is_an_error_naming_the_field(split, devices, message):
    with pytest.raises(ValueError, match=f"layer_split: .*{message}"):
        ranges_from_split(split, 6, devices)


def test_more_devices_than_layers_is_an_error(cfg):
    with pytest.raises(ValueError, match="devices: 7 devices but the model has only 6 layers"):
        plan_split(cfg, ["cpu"] * 7, torch.float32, max_context=64)


def test_equal_devices_get_about_equal_bytes(cfg):
    ranges = plan_split(
        cfg, ["cuda:0", "cuda:1"], torch.bfloat16, max_context=1024, free_bytes=[80 * GiB] * 2
    )
    sizes = [shard_bytes(cfg, r, torch.bfloat16, 1024) for r in ranges]
    largest_layer = max(layer_weight_bytes(cfg, torch.bfloat16)) + shard_bytes(
        cfg, range(0, 1), torch.bfloat16
    )
    assert ranges[0].start == 0 and ranges[0].stop == ranges[1].start and ranges[1].stop == 6
    assert abs(sizes[0] - sizes[1]) <= largest_layer


def test_a_device_with_more_free_memory_gets_more_layers(cfg):
    even = plan_split(cfg, ["cuda:0", "cuda:1"], torch.bfloat16, max_context=1024, free_bytes=[40 * GiB] * 2)
    skewed = plan_split(
        cfg, ["cuda:0", "cuda:1"], torch.bfloat16, max_context=1024, free_bytes=[120 * GiB, 40 * GiB]
    )
    assert len(skewed[0]) > len(even[0])


def test_every_device_keeps_at_least_one_layer(cfg):
    ranges = plan_split(
        cfg, ["cpu"] * 3, torch.float32, max_context=64, free_bytes=[10**12, 10**9, 10**9], reserve=0
    )
    assert [len(r) >= 1 for r in ranges] == [True] * 3 and ranges[-1].stop == 6


def test_a_split_that_does_not_fit_is_an_error_naming_the_device(cfg):
    need = shard_bytes(cfg, range(0, 3), torch.float32, 64)
    with pytest.raises(ValueError, match=r"devices: layers 0-2 need .* on cuda:0"):
        plan_split(
            cfg,
            ["cuda:0", "cuda:1"],
            torch.float32,
            max_context=64,
            layer_split=[3, 3],
            free_bytes=[need - 1, 10 * need],
            reserve=0,
        )
