"""Triton launches recorded once and replayed with some tensors swapped.

Why: Triton's Python launch path (argument binding, the specialisation key, the cache
lookup, the launch hooks) runs for every launch of a kernel of ~40 arguments, and our
wrappers' checks add more. The piecewise CUDA graphs
(``runtime/executor/piecewise_cuda_graph``) launch each layer's attention eagerly: a mixed
step of the 8B shape still spent 6-11 ms of host time launching (H100, 2026-12-05), more
than the device needs for a few hundred tokens; with the replay ~1.4-1.8x less (2026-12-06,
measured across H100 hosts; BENCHMARKS.md "Piecewise CUDA graphs"). Between two layers of
one step only the KV pool tensors change: the query and output buffers are static, the grid,
split counts, page table and lengths are the step's. So layer 0 launches through Triton
inside ``record()``, and layers 1.. replay those launches with the layer's pools swapped in,
straight through each compiled kernel's launcher (what ``JITFunction.run`` ends with;
SGLang's ``wrap_kernel_launcher`` and PyTorch Inductor launch the same way).

A replay is valid only where the swapped tensors match the recorded ones in everything
Triton specialises on: dtype, strides given as arguments (the caller's), and 16-byte
alignment (checked per replay). Under the Triton interpreter (``TRITON_INTERPRET=1``) a
launch returns no compiled kernel; a replay then launches through ``fn[grid]`` again with
the swapped arguments, so the same code runs (slowly) on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import triton

__all__ = ["RecordedLaunch", "jit_unspecialised", "launch", "record"]

_recording: list[RecordedLaunch] | None = None


def jit_unspecialised(*names: str) -> Any:
    """``triton.jit`` that specialises none of the arguments ``names``: neither an integer
    on the value 1 or on divisibility by 16, nor a pointer on 16-byte alignment. For
    arguments that vary from launch to launch (split counts, page-table widths, slices of
    a batch's vectors): Triton compiles one more binary (seconds) for each new combination
    of such properties, the first time it occurs, in the middle of serving."""
    return triton.jit(do_not_specialize=list(names), do_not_specialize_on_alignment=list(names))


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``fn[grid](*args, **kwargs)`` (a ``triton.jit`` function), appended to the open
    ``record()`` list if any. Returns Triton's compiled kernel (None under the interpreter)."""
    compiled = fn[grid](*args, **kwargs)
    if _recording is not None:
        _recording.append(RecordedLaunch(fn, grid, args, kwargs, compiled))
    return compiled


@contextmanager
def record() -> Iterator[list[RecordedLaunch]]:
    """Collect the ``launch`` calls made inside the block, in order. Not reentrant; the
    scheduler's one thread uses it.

    Raises RuntimeError if a recording is already open.
    """
    global _recording
    if _recording is not None:
        raise RuntimeError("a launch recording is already open")
    _recording = launches = []
    try:
        yield launches
    finally:
        _recording = None


class RecordedLaunch:
    """One recorded launch: ``replay`` launches it again with some tensor arguments swapped.

    ``fn`` is the ``triton.jit`` function, ``grid`` its (x[, y[, z]]) grid, ``args`` /
    ``kwargs`` the call's arguments (launch options such as ``num_warps`` among the
    kwargs), ``compiled`` what the launch returned.
    """

    __slots__ = ("args", "compiled", "fn", "grid", "kwargs", "values", "_runner")

    def __init__(self, fn: Any, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any], compiled: Any) -> None:
        self.fn, self.grid, self.args, self.kwargs, self.compiled = fn, grid, args, kwargs, compiled
        self._runner = None
        self.values: list[Any] = []
        if compiled is not None:  # the launcher takes every parameter, constexprs included
            params = fn.signature.parameters
            bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
            bound.apply_defaults()
            self.values = list(bound.arguments.values())
            grid3 = (*grid, 1, 1)[:3]
            self._runner = compiled[grid3]

    def positions(self, tensors: Sequence[torch.Tensor]) -> list[list[int]]:
        """For each of ``tensors``, the positional argument slots holding that very object
        (``values`` and ``args`` share them: positional arguments come first)."""
        return [[i for i, a in enumerate(self.args) if a is t] for t in tensors]

    def replay(self, slots: list[list[int]], tensors: Sequence[torch.Tensor], stream: int | None = None) -> None:
        """Launch again with ``tensors[j]`` in the argument slots ``slots[j]`` (from
        ``positions``), on ``stream`` (a raw CUDA stream handle; None: the current one).

        Raises ValueError if a swapped tensor is not 16-byte aligned while the recorded one
        was (Triton compiled for the alignment)."""
        if self._runner is None:  # interpreter: through Triton again
            args = list(self.args)
            for where, t in zip(slots, tensors, strict=True):
                for i in where:
                    args[i] = t
            self.fn[self.grid](*args, **self.kwargs)
            return
        values = self.values.copy()
        for where, t in zip(slots, tensors, strict=True):
            for i in where:
                if t.data_ptr() % 16 and not values[i].data_ptr() % 16:
                    raise ValueError(f"argument {i} of {self.fn.__name__}: the swapped tensor is not 16-byte aligned")
                values[i] = t
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        self._runner(*values, stream=stream)
