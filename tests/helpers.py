"""Small helpers shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, TypeVar

import pytest
import torch


def sm90_ptx(script: str) -> dict:
    """Run ``script`` (which compiles kernels for sm_90 and prints a JSON object of their PTX) in a process
    without Triton's interpreter, and return that object; skip when this machine cannot compile for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
    )
    if done.returncode != 0:
        if "ptxas" in done.stderr or "No module named" in done.stderr:
            pytest.skip(f"cannot compile for sm_90 here: {done.stderr[-300:]}")
        raise AssertionError(done.stderr[-3000:])
    return json.loads(done.stdout)


def loads_before_pdl_wait(ptx: str) -> int:
    """How many global loads a kernel's PTX issues before its ``griddepcontrol.wait``."""
    return ptx[: ptx.index("griddepcontrol.wait")].count("ld.global")


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` relative to ``b``'s largest magnitude."""
    return float((a - b).abs().max() / b.abs().max())


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp32 (2-norms), after checking that ``a`` is finite: an element a kernel did not
    write shows up as non-finite in a poisoned allocation."""
    assert torch.isfinite(a).all(), "non-finite output (an element was not written?)"
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_prompt(n: int, seed: int, vocab: int = 128000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def static_decode_setup(
    tiny_factory, seed: int, prompt_seed: int, length: int, prefilled: int, capacity: int
):
    """A tiny model whose static steps close CSA and HCA windows and wrap the ring (window 8, HCA
    ratio 8, indexer top-5), a random prompt of ``length``, and two states with its first
    ``prefilled`` tokens committed: ``(model, ids, (state_a, state_b))``."""
    from ds4serve.model import DeepSeekV4
    from ds4serve.weights import Checkpoint

    model = DeepSeekV4.load(Checkpoint(tiny_factory(seed=seed, window=8, hca_rate=8, index_topk=5)))
    ids = random_prompt(length, seed=prompt_seed)
    states = model.new_state(capacity), model.new_state(capacity)
    for state in states:
        state.commit(model.forward(ids[:prefilled], state).delta, prefilled)
    return model, ids, states


def assert_states_close(a, b) -> None:
    """Two sequence states at the same position hold the same committed rows (fp32 tolerance 1e-5)."""
    assert a.pos == b.pos
    sa, sb = a.snapshot(), b.snapshot()
    for idx, saved in sa.layers.items():
        for name, t in saved.items():
            torch.testing.assert_close(
                sb.layers[idx][name], t, rtol=1e-5, atol=1e-5, msg=f"layer {idx} {name}"
            )


def static_step(model, state, token: int):
    """The static one-token forward (the CUDA-graph path) at ``state.pos``: ``(result, positions)``."""
    positions = torch.tensor([state.pos])
    return model.forward(torch.tensor([token]), state, logit_rows=slice(0, 1), positions=positions), positions


# A tool definition and the DSML completion that calls it (chat-format and server tool tests).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def spy_launches(monkeypatch, module, name: str) -> list[int]:
    """Record the launches of the Triton kernel ``module.name`` (``kernel[grid](...)``): the list of their
    grids' first sizes, filled as they are issued."""
    launches: list[int] = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid[0])
            return kernel[grid]

    monkeypatch.setattr(module, name, Spy())
    return launches


T = TypeVar("T")


def without_host_sync(run: Callable[[], T]) -> T:
    """``run()`` once (its compiles synchronise), then again under CUDA's sync debug mode "error", where any
    synchronisation with the host raises; returns the second run's result."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
