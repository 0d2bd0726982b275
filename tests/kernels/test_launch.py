"""radixlm.kernels.launch: a recorded Triton launch replays with tensors swapped (through
the compiled kernel's launcher on CUDA, through Triton again under the interpreter)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from radixlm.kernels.launch import launch, record  # noqa: E402

from .conftest import DEVICE  # noqa: E402


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr, PLUS_ONE: tl.constexpr = False):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    val = a * tl.load(x_ptr + i, mask=mask) + tl.load(y_ptr + i, mask=mask)
    if PLUS_ONE:
        val += 1.0
    tl.store(out_ptr + i, val, mask=mask)


def test_replay_swaps_the_named_tensors_and_keeps_the_rest() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(40, generator=gen).to(DEVICE) for _ in range(3)]
    y = torch.randn(40, generator=gen).to(DEVICE)
    out = torch.zeros(40, device=DEVICE)
    with record() as launches:
        launch(_axpy_kernel, (3,), xs[0], y, out, 2.0, 40, BLOCK=16, num_warps=1)  # PLUS_ONE's default
    assert len(launches) == 1 and launches[0].grid == (3,)
    torch.testing.assert_close(out, 2 * xs[0] + y)
    slots = launches[0].positions((xs[0], out))
    assert slots == [[0], [2]]
    other = torch.zeros(40, device=DEVICE)
    for x in xs[1:]:
        launches[0].replay(slots, (x, other))
        torch.testing.assert_close(other, 2 * x + y)  # the scalar, y and the grid kept
    torch.testing.assert_close(out, 2 * xs[0] + y)  # the recorded output untouched
    launch(_axpy_kernel, (3,), xs[0], y, out, 2.0, 40, BLOCK=16)  # outside record(): not collected
    assert len(launches) == 1


def test_record_is_not_reentrant_and_closes_on_error() -> None:
    with record(), pytest.raises(RuntimeError, match="already open"), record():
        pass
    with pytest.raises(KeyError), record():
        raise KeyError("x")
    with record() as launches:  # closed again after the error
        assert launches == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_refuses_a_tensor_less_aligned_than_the_recorded_one() -> None:
    x = torch.randn(41, device="cuda")
    aligned, y, out = x[:40], torch.randn(40, device="cuda"), torch.zeros(40, device="cuda")
    with record() as launches:
        launch(_axpy_kernel, (3,), aligned, y, out, 1.0, 40, BLOCK=16)
    assert launches[0].compiled is not None
    slots = launches[0].positions((aligned,))
    assert slots == [[0]]
    with pytest.raises(ValueError, match="16-byte aligned"):
        launches[0].replay(slots, (x[1:],))  # 4 bytes off
