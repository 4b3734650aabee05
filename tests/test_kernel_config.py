"""The kernel configuration is decided when the engine is built and read through one module."""

import torch

from ds4serve import Engine, kernels
from ds4serve.cli import build_parser, load_engine
from ds4serve.kernels import config


def test_an_engine_built_with_a_configuration_installs_it(tiny_dir):
    before = config.current()
    try:
        engine = Engine.from_pretrained(tiny_dir, kernels=config.KernelConfig(triton=False, any_device=True))
        assert config.current() is engine.kernels and not engine.kernels.triton
        assert not kernels.enabled(torch.zeros(1))
        config.install(config.KernelConfig(any_device=True))
        assert kernels.enabled(torch.zeros(1))
    finally:
        config.install(before)


def test_the_cli_flags_choose_the_torch_reference_and_no_pdl(tiny_dir):
    before = config.current()
    try:
        args = build_parser().parse_args(
            ["generate", "--model", str(tiny_dir), "--torch-reference", "--no-pdl", "x"]
        )
        engine, _, _ = load_engine(args)
        assert (engine.kernels.triton, engine.kernels.pdl) == (False, False)
    finally:
        config.install(before)
