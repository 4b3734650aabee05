"""bench/graph_timeline.py: a replay's kernel start times read as each kernel's cost to the chain, and the
launches of Inductor's generated modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the benchmark imports the kernels")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from graph_timeline import chain_costs, launch_summary, write_inductor_code  # noqa: E402


def test_without_pdl_a_kernel_costs_the_time_to_the_next_start():
    assert chain_costs([0.0, 2.0, 12.0, 13.5], pdl=False) == [2.0, 10.0, 1.5, None]


def test_under_pdl_the_next_start_marks_the_end_of_the_kernel_before():
    # kernel 1 (10 us) lets kernel 2 start at once and kernel 3 only when it ends
    starts = [0.0, 1.0, 2.0, 12.0, 13.0]
    assert chain_costs(starts, pdl=True) == [1.0, 10.0, 1.0, None, None]


_MODULE = '''
triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', """ def call(): pass """)

def call(self, args):
        arg0_1, arg1_1 = args
        # Topologically Sorted Source Nodes: [rope, cat], Original ATen: [aten.mul, aten.cat]
        stream0 = get_raw_stream(0)
        triton_poi_fused_0.run(arg0_1, buf0, 512, stream=stream0)
        buf1 = torch.ops.ds4serve.gemv.default(buf0, arg1_1, None, 0, 0, 1)
        # Topologically Sorted Source Nodes: [norm], Original ATen: [aten.pow, aten.mean]
        triton_per_fused_1.run(buf1, buf2, 1, 4096, stream=stream0)
        return (buf2, )
'''


def test_launch_summary_lists_launches_in_order_with_their_sources():
    assert launch_summary(_MODULE) == [
        "# Topologically Sorted Source Nodes: [rope, cat], Original ATen: [aten.mul, aten.cat]",
        "-> triton_poi_fused_0",
        "-> torch.ops.ds4serve.gemv",
        "# Topologically Sorted Source Nodes: [norm], Original ATen: [aten.pow, aten.mean]",
        "-> triton_per_fused_1",
    ]


def test_write_inductor_code_keeps_only_modules_with_a_call(tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "wrapper.py").write_text(_MODULE)
    (tmp_path / "ab" / "kernel.py").write_text("def triton_poi_fused_0(): pass\n")
    out = tmp_path / "code.txt"
    assert write_inductor_code(tmp_path, out) == 1
    text = out.read_text()
    assert text.startswith("#### wrapper.py\n# Topologically") and "-> triton_per_fused_1" in text
