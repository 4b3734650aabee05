"""Arrival counters: the last program of a group to finish its part finishes the group's work.

A batch-1 decode kernel often ends in a small reduction over its programs' partials (the mHC site's
mixes, the MoE's expert slots, a split-K GEMV's slices). A second launch for it costs more than the
arithmetic. Instead each program stores its partial, then counts itself in on its group's counter;
the program that arrives last reads every partial of the group, in a fixed order (deterministic,
whichever program came last), and writes the result.

Memory ordering: a program's partials are stored by several threads; ``tl.debug_barrier()`` (``bar.sync``)
orders those stores before the one ``atom.acq_rel.gpu.add`` of the counter, whose release is cumulative over
what the barrier made the atomic's thread observe, so it publishes all of them at GPU scope. The last
program's atomic reads the value every other program's release wrote (the counter's read-modify-writes are
totally ordered), so its acquire makes their partials visible to it; Triton hands the atomic's result to
the program's other threads through shared memory and a barrier, which orders their loads after the
acquire. Readers load the partials with ``cache_modifier=".cg"`` (at L2, not through L1), so no line cached
in their SM's L1 can be stale.

The last program also resets its counter to 0: no program of the launch touches it after the last
increment, and the next launch in the stream starts only after this one has ended (with programmatic
dependent launch too: every kernel's ``griddepcontrol.wait`` precedes its memory accesses and waits for the
whole previous grid and its writes). The counters are therefore zero at every launch, which lets them be
one buffer per device shared by every such kernel (:func:`counters`) rather than a zero-filled tensor per
call: inside a CUDA graph that fill would be one more launch, and it would break the PDL chain. Hence also:
two launches that use counters must not run concurrently on one device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: a captured graph may still point at them


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zero int32 arrival counters on ``device``, cached (the kernels leave them zero).

    During a CUDA-graph capture a missing buffer cannot be made here (its zero fill would only run at
    replay): the launch then gets zeros of its own, one captured fill. The engine's graphs run their step
    eagerly before capturing it, so the cached buffer exists by then.
    """
    have = _COUNTERS.get(device)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, device=device, dtype=torch.int32)
    if have is not None:
        _OUTGROWN.append(have)
    _COUNTERS[device] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return _COUNTERS[device]


@triton.jit
def last_to_arrive(count_ptr, arrivals):
    """True in the program that is the ``arrivals``-th to count itself in at ``count_ptr`` (after all of
    its threads' earlier stores), which also resets the counter; False in the others."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.store(count_ptr, 0)
    return last


@triton.jit
def signal(flag_ptr):
    """Set the flag at ``flag_ptr`` for a program waiting on it (:func:`wait_for`), publishing what this program
    has seen: called by the last program to arrive, it hands the group's partials on."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, 1, sem="release")


@triton.jit
def wait_for(flag_ptr):
    """Spin until the flag at ``flag_ptr`` is set (:func:`signal`), then reset it to 0 (as every launch expects
    it) in the same atomic, which acquires what the signalling program had seen.

    The waiting program is one more program of the launch than the group it waits for, and the last in launch
    order: on the GPU the group's programs do not need its slot (they never wait), so they reach the flag
    whatever the scheduling; Triton's interpreter runs programs one after another in launch order, so there the
    flag is set before the first try."""
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire") != 1:
        pass
