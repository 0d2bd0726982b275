"""Gemma (Gemma Team, "Gemma: Open Models Based on Gemini Research and Technology", 2024),
Gemma 2 ("Gemma 2: Improving Open Language Models at a Practical Size", 2024) and Gemma 3
text ("Gemma 3 Technical Report", 2025).

What they change in the shared decoder:

- norms ``x̂ (1 + w)``: 1 is added to every checkpoint norm weight on load;
- embeddings times sqrt(E) (rounded to the model dtype first, as Hugging Face does);
- GeGLU MLP (``gelu_pytorch_tanh``);
- Gemma 2/3: sandwich norms (attention output and MLP output normed before each residual
  add), softmax scale ``query_pre_attn_scalar ** -0.5``, local (sliding window) and global
  layers alternating per ``config.layer_types`` (Gemma 2: every other layer; Gemma 3: five
  local to one global);
- Gemma 2: attention-logit soft-capping ``cap * tanh(s / cap)`` (50) and final-logit
  soft-capping (30);
- Gemma 3: q/k RMSNorm per head, no soft-capping, and a RoPE per layer type (local layers
  base 10k, ``rope_local_base_freq``; global layers ``rope_theta`` with their own scaling).

Gemma 3's multimodal ``Gemma3ForConditionalGeneration`` is not supported (text only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from radixlm.runtime.executor.attention import LayerAttention
from radixlm.runtime.executor.models.decoder import (
    CausalLM,
    DecoderSpec,
    LayerSpec,
    rope_key,
    sliding_window,
)

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaForCausalLM"]


def _activation(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")


class GemmaForCausalLM(CausalLM):
    """Gemma 1: (1 + w) norms, sqrt(E) embedding scale, GeGLU."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(norm_offset=1.0, embed_scale=math.sqrt(config.hidden_size), activation=_activation(config))


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: sandwich norms, soft-capping, alternating local / global layers."""

    qk_norm = False

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qk_norm=cls.qk_norm, sandwich_norms=True, norm_offset=1.0,
                           embed_scale=math.sqrt(config.hidden_size), activation=_activation(config),
                           final_softcap=getattr(config, "final_logit_softcapping", None))  # fmt: skip

    @classmethod
    def layer_spec(cls, config: Any, layer_id: int) -> LayerSpec:
        attention = LayerAttention(scale=config.query_pre_attn_scalar**-0.5,
                                   softcap=getattr(config, "attn_logit_softcapping", None),
                                   window=sliding_window(config, layer_id))  # fmt: skip
        return LayerSpec(attention, rope_key(config))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layout with q/k norms and a RoPE per layer type."""

    qk_norm = True

    @classmethod
    def layer_spec(cls, config: Any, layer_id: int) -> LayerSpec:
        return dataclasses.replace(super().layer_spec(config, layer_id),
                                   rope=rope_key(config, config.layer_types[layer_id]))  # fmt: skip
