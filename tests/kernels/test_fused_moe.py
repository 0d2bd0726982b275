"""The fused MoE kernel (kernels/fused_moe.py) against ``reference.fused_moe``: the Triton
interpreter on the CPU (float32, tiny shapes), bf16 on a GPU; uneven expert loads and experts
that receive no token. Also the routing normalisations against transformers' formulas.

Dimension letters: T tokens, k experts per token, X experts, E hidden, F expert intermediate.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import reference
from radixlm.kernels.fused_moe import MoeConfig, fused_moe, moe_align_block_size

from .conftest import DEVICE

pytest.importorskip("triton")


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str
             ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5  # [X, 2F, E]
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5  # [X, E, F]
    return w13.to(device, dtype), w2.to(device, dtype)


def _skewed_ids(num_tokens: int, top_k: int, num_experts: int, idle: set[int], seed: int) -> torch.Tensor:
    """[T, k] distinct experts per token, expert 0 picked far more often than the others,
    the experts in ``idle`` never."""
    g = torch.Generator().manual_seed(seed)
    busy = [e for e in range(num_experts) if e not in idle]
    bias = torch.tensor([8.0 if e == busy[0] else 1.0 for e in busy])
    rows = [torch.multinomial(bias, top_k, generator=g) for _ in range(num_tokens)]
    return torch.tensor(busy)[torch.stack(rows)]


def test_align_pads_each_expert_to_the_block_and_skips_idle_experts() -> None:
    ids = torch.tensor([[0, 3], [0, 3], [3, 0], [0, 1], [0, 3]])  # expert 0: 5 pairs, 1: 1, 2: 0, 3: 4
    sorted_ids, block_expert, num_post = moe_align_block_size(ids, num_experts=4, block_m=4)
    m = ids.numel()
    assert num_post.tolist() == [8 + 4 + 4]  # 5 -> 8, 1 -> 4, 0 -> 0, 4 -> 4
    assert block_expert[:4].tolist() == [0, 0, 1, 3]  # expert 2 has no block
    assert sorted_ids.shape == (m + 4 * 3,)
    runs = {0: sorted_ids[0:8], 1: sorted_ids[8:12], 3: sorted_ids[12:16]}
    for expert, run in runs.items():
        real = run[run < m]
        assert sorted(real.tolist()) == sorted(torch.nonzero(ids.reshape(-1) == expert)[:, 0].tolist())
        assert (run[len(real):] == m).all()  # padding after the real pairs
    assert (sorted_ids[16:] == m).all()


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "idle", "config"),
    [
        (1, 2, 4, {1, 3}, MoeConfig(16, 16, 16, 1, 1)),  # batch-1 decode: two experts see nothing
        (9, 2, 6, {2}, MoeConfig(4, 16, 16, 1, 1)),  # uneven loads over several BM blocks
        (13, 3, 5, set(), MoeConfig(8, 32, 32, 1, 1)),  # E and F not multiples of the tiles
    ],
)
def test_fused_moe_matches_reference(num_tokens: int, top_k: int, num_experts: int, idle: set[int],
                                     config: MoeConfig) -> None:  # fmt: skip
    hidden, inter = (48, 40) if config.block_n == 32 else (32, 24)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w13, w2 = _weights(num_experts, hidden, inter, dtype, DEVICE)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    ids = _skewed_ids(num_tokens, top_k, num_experts, idle, seed=3).to(DEVICE)
    weights = torch.softmax(torch.randn(num_tokens, top_k), dim=-1).to(DEVICE)
    got = fused_moe(x, w13, w2, weights, ids, config).float()
    want = reference.fused_moe(x, w13, w2, weights, ids).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bf16 on the GPU: relative error within 1e-2
        assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_reference_matches_a_dense_per_token_loop() -> None:
    """``reference.fused_moe`` = sum_j w[t, j] * expert_{ids[t, j]}(x_t), token by token."""
    w13, w2 = _weights(4, 16, 8, torch.float32, "cpu")
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2], [3, 0], [0, 3]])
    weights = torch.rand(5, 2)
    want = torch.zeros(5, 16)
    for t in range(5):
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_routing_normalisations() -> None:
    """Mixtral: softmax over the top-k logits; Qwen3-MoE: softmax over all, top-k, optionally
    renormalised."""
    logits = torch.randn(6, 8)
    top, ids = torch.topk(logits, 2, dim=-1)
    w, got_ids = reference.moe_route(logits, 2, renormalize=True)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1))
    w, _ = reference.moe_route(logits, 2, renormalize=False)
    torch.testing.assert_close(w, torch.softmax(logits, dim=-1).gather(1, ids))
