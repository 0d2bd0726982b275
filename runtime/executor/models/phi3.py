"""Phi-3 / Phi-3.5 / Phi-4-mini (Abdin et al., "Phi-3 Technical Report", 2024).

Llama layers whose checkpoints already fuse q/k/v (``qkv_proj``) and gate/up
(``gate_up_proj``): they load into the shared decoder's merged parameters as they are. RoPE
may be LongRoPE ("su" / "longrope": short and long per-frequency factors, cos / sin scaled by
sqrt(1 + ln(s) / ln(L0)); ``layers.RotaryEmbedding``) and partial (Phi-4-mini rotates 3/4 of
each head); both run the PyTorch RoPE instead of the fused kernel. A ``sliding_window`` in
config.json (Phi-3-mini: 2047) applies to every layer, as in Hugging Face.
"""

from __future__ import annotations

from radixlm.runtime.executor.models.decoder import CausalLM

__all__ = ["Phi3ForCausalLM"]


class Phi3ForCausalLM(CausalLM):
    """Phi-3: the shared decoder; fused checkpoint tensors, LongRoPE, partial rotary."""
