"""Qwen3 dense and Qwen3-MoE (Yang et al., "Qwen3 Technical Report", 2025).

Qwen3 is the shared decoder with an RMSNorm over the head dim of every q and k head before
RoPE (``DecoderSpec.qk_norm``) and no q/k/v biases (``attention_bias``). Qwen3-MoE replaces
the MLP of the layers ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers`` by a
sparse MoE block: softmax over all experts, top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` (``moe.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixlm.runtime.executor.models.decoder import CausalLM, DecoderSpec, LayerSpec

__all__ = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense: q/k RMSNorm per head."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (e.g. Qwen3-30B-A3B: 128 experts, 8 per token)."""

    @classmethod
    def layer_spec(cls, config: Any, layer_id: int) -> LayerSpec:
        sparse = (layer_id not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
                  and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0)  # fmt: skip
        return dataclasses.replace(super().layer_spec(config, layer_id), moe=sparse)
