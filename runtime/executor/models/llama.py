"""Llama (Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023) and
Qwen2 (Yang et al., "Qwen2 Technical Report", 2024): the shared decoder with its defaults
(``decoder.py``); Qwen2 adds biases on q/k/v and, with ``use_sliding_window``, a sliding
window on the layers from ``max_window_layers`` on (``config.layer_types``).

The layers themselves live in ``decoder.py`` and ``layers.py``; the names below are kept
importable from here.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.executor.models.decoder import CausalLM, DecoderSpec
from radixlm.runtime.executor.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    rope_parameters,
)

__all__ = ["LlamaForCausalLM", "Qwen2ForCausalLM", "RMSNorm", "RotaryEmbedding", "apply_rope", "rope_parameters"]


class LlamaForCausalLM(CausalLM):
    """Llama 2 / 3 / 3.x (and SmolLM2): RMSNorm, SwiGLU, RoPE with llama3 scaling, GQA."""


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
