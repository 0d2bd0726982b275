"""Mistral (Jiang et al., "Mistral 7B", 2023) and Mixtral (Jiang et al., "Mixtral of
Experts", 2024).

Mistral is the shared decoder with sliding-window attention on every layer where config.json
has a ``sliding_window`` (Mistral 7B v0.1: 4096; later versions: null). A query at position
p attends to keys p - W + 1 .. p; the keys behind the window stay in the KV pool (no page is
freed early) and are masked out by the attention backend (``LayerAttention.window``).

Mixtral adds a sparse MoE block in every layer: 8 experts, 2 per token, routing weights a
softmax over the top-2 router logits. Checkpoints name it ``block_sparse_moe`` with experts'
``w1`` (gate), ``w3`` (up) and ``w2`` (down), renamed on load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixlm.runtime.executor.models.decoder import CausalLM, LayerSpec

__all__ = ["MistralForCausalLM", "MixtralForCausalLM"]


class MistralForCausalLM(CausalLM):
    """Mistral 7B / Nemo / Small: Llama layers, sliding window per config."""


class MixtralForCausalLM(CausalLM):
    """Mixtral 8x7B / 8x22B: a MoE block in every layer."""

    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )

    @classmethod
    def layer_spec(cls, config: Any, layer_id: int) -> LayerSpec:
        return dataclasses.replace(super().layer_spec(config, layer_id), moe=True)
