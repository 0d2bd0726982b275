"""Sparse mixture-of-experts MLP block (Mixtral, Qwen3-MoE).

Dimension letters: T tokens, E hidden size, F expert intermediate size, X experts, k experts
per token.

    x [T, E] -> gate (router linear) -> logits [T, X] -> top-k routing (``reference.moe_route``)
      -> fused MoE (``kernels/fused_moe.py`` on CUDA, ``reference.fused_moe`` elsewhere) -> [T, E]

Routing normalisation per family: Mixtral renormalises the top-k softmax probabilities
(= a softmax over the top-k logits; Jiang et al., "Mixtral of Experts", 2024); Qwen3-MoE
takes the softmax over all experts, then the top k, renormalised only with
``norm_topk_prob`` (Qwen3 technical report, 2025).

Expert weights are stacks: ``experts.gate_up_proj`` [X, 2F, E] (gate rows then up rows) and
``experts.down_proj`` [X, E, F], the layout transformers 5 keeps in memory; the loader fills
them from per-expert checkpoint tensors (``CausalLM.load_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixlm.kernels import reference

__all__ = ["MoeSpec", "SparseMoeBlock", "moe_spec"]


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A MoE block's shape and routing: X experts, k per token, F, renormalise top-k."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool


def moe_spec(config: Any) -> MoeSpec:
    """From config.json: Mixtral's ``num_local_experts`` (always renormalised) or Qwen3-MoE's
    ``num_experts`` / ``moe_intermediate_size`` / ``norm_topk_prob``."""
    if getattr(config, "moe_intermediate_size", None):  # Qwen3-MoE (its config also answers num_local_experts)
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(getattr(config, "norm_topk_prob", False)))  # fmt: skip
    return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)


class Experts(nn.Module):
    """The X experts' SwiGLU weights as stacks (module docstring)."""

    def __init__(self, spec: MoeSpec, hidden_size: int) -> None:
        super().__init__()
        x, f = spec.num_experts, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(x, 2 * f, hidden_size))  # [X, 2F, E]
        self.down_proj = nn.Parameter(torch.empty(x, hidden_size, f))  # [X, E, F]


class SparseMoeBlock(nn.Module):
    """Router + experts; ``forward`` x [T, E] -> [T, E] in x's dtype."""

    def __init__(self, spec: MoeSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = reference.moe_route(self.gate(x), self.spec.top_k, self.spec.renormalize)  # [T, k] each
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if x.is_cuda:
            from radixlm.kernels.fused_moe import fused_moe

            return fused_moe(x.contiguous(), w13, w2, weights, ids)
        return reference.fused_moe(x, w13, w2, weights, ids)
