"""Programmatic dependent launch (``config.current().pdl``, kernels/pdl.py).

The launches themselves need a Hopper GPU (bench/check_gpu.py runs the model checks with PDL on).
Here: the CPU path ignores it, and a kernel compiles for sm_90 with the grid-dependency
instructions where they make it safe (the wait before any load, then the release of the next grid).
"""

from __future__ import annotations

import pytest
import torch

from ds4serve import kernels
from ds4serve.kernels import config, pdl
from tests.helpers import sm90_ptx

triton = pytest.importorskip("triton")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter runs only on machines without a GPU"
)
def test_cpu_launches_ignore_pdl():
    """Triton's interpreter takes neither the launch option nor the instructions."""
    from ds4serve.kernels.gemv import gemv, gemv_ref

    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    with config.using(pdl=True):
        assert pdl.launch(x) == {"PDL": False}
        with kernels.on_any_device():
            got = gemv(x, w)
    torch.testing.assert_close(got, gemv_ref(x, w), rtol=1e-5, atol=1e-5)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ds4serve.kernels import gemv

args = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32",
        "n_in": "i32", "k_per_split": "i32", "rows_per_group": "i32", "x_stride": "i32", "s_cols": "i32",
        "n_tokens": "i32"}
ptx = {}
for pdl in (False, True):
    consts = dict(SCALED=True, SB_R=128, SB_C=128, N_PAD=16, BLOCK_R=64, BLOCK_K=128, SUB_K=128, STAGES=4,
                  PARTIAL=False, DOT_DTYPE=triton.language.float16, N_LOAD=1, X_SCALE=2.0 ** -8, PDL=pdl)
    source = ASTSource(gemv._gemv_dot_kernel, {**args, **dict.fromkeys(consts, "constexpr")}, consts)
    ptx[str(pdl)] = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
json.dump(ptx, sys.stdout)
"""


@pytest.fixture(scope="module")
def sm90_gemv_ptx() -> dict[str, str]:
    """The FP8 tensor-core GEMV compiled for sm_90 (PTX) without and with PDL; in a process of its
    own, since this one runs Triton's interpreter."""
    return sm90_ptx(_COMPILE)


def test_gemv_compiles_for_hopper_with_pdl(sm90_gemv_ptx):
    ptx = sm90_gemv_ptx["True"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < release
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
    assert wait < first_load  # nothing the previous kernel writes is read before the wait


def test_gemv_without_pdl_has_no_grid_dependency_instructions(sm90_gemv_ptx):
    assert "griddepcontrol" not in sm90_gemv_ptx["False"]
