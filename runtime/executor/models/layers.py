"""Layers every model family shares: RMSNorm, rotary embeddings, activations, soft-capping.

Dimension letters: T new tokens in the pass, E hidden size, H heads, D head dim,
R rotary dims (``partial_rotary_factor * D``, D unless a family rotates part of the head).

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021) in
the Hugging Face rotate-half (GPT-NeoX) layout, with the frequency scalings the supported
checkpoints use: "default", "linear" (position interpolation, Chen et al. 2023), "llama3"
(Llama 3.1) and "longrope" (Phi-3's "su"/"longrope", Ding et al., "LongRoPE: Extending LLM
Context Window Beyond 2 Million Tokens", 2024).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "rope_parameters",
    "softcap",
]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like Hugging Face
    (Zhang and Sennrich, "Root Mean Square Layer Normalization", 2019).

    Gemma's (1 + w) norms are this module with 1 added to the checkpoint's w at load time
    (``CausalLM.load_weights``), so the fused norm kernels serve them unchanged.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> [..., E], same dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-capping ``cap * tanh(x / cap)`` (identity for cap None)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# config.json hidden_act / hidden_activation -> the gate activation of a gated MLP.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    Reads ``config.rope_parameters`` (transformers >= 5; per layer type for Gemma 3, whose
    local layers have their own base frequency) or ``config.rope_scaling`` +
    ``config.rope_theta`` (older). ``original_max_position_embeddings`` and
    ``partial_rotary_factor`` fall back to the config's top-level fields.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    for key in ("original_max_position_embeddings", "partial_rotary_factor", "max_position_embeddings"):
        if params.get(key) is None and getattr(config, key, None) is not None:
            params[key] = getattr(config, key)
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, smooth between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[R/2] float32 ``theta ** (-2i / R)`` on the CPU."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (theta**exponents)


def _longrope_attention_factor(params: dict[str, Any]) -> float:
    """LongRoPE's cos / sin scale: sqrt(1 + ln(s) / ln(L0)) with s = L / L0 (Phi-3)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


class RotaryEmbedding(nn.Module):
    """cos / sin tables for the new tokens' positions (rotate-half layout).

    ``rotary_dim`` R <= D: the first R channels of each head rotate (``partial_rotary_factor``).
    LongRoPE keeps two frequency sets: a token at position p >= L0
    (``original_max_position_embeddings``) uses the long factors, earlier ones the short
    ones. Hugging Face picks one set per forward call from the longest position in it; per
    token keeps every cached key valid as a sequence grows past L0 (vLLM picks per batch).
    ``fusable``: the fused Triton RoPE kernel computes the same thing (full rotation, one
    frequency set, no cos / sin scale).
    """

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        base = _base_inv_freq(self.rotary_dim, params["rope_theta"])
        rope_type = params["rope_type"]
        self.attention_factor = 1.0
        self._long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        if rope_type == "default":
            inv_freq = base
        elif rope_type == "linear":
            inv_freq = base / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(base, params)
        elif rope_type == "longrope":
            inv_freq = base / torch.tensor(params["short_factor"], dtype=torch.float32, device="cpu")
            self._long_inv_freq = base / torch.tensor(params["long_factor"], dtype=torch.float32, device="cpu")
            self.long_from = int(params["original_max_position_embeddings"])
            self.attention_factor = _longrope_attention_factor(params)
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, longrope)")
        # Plain attributes, not buffers: built on the CPU even under a meta-device context,
        # moved to the compute device on first use.
        self._inv_freq = inv_freq  # [R/2] float32
        self.fusable = self.rotary_dim == head_dim and self._long_inv_freq is None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[R/2] float32 inverse frequencies (the short set for LongRoPE) on ``device``."""
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, R] in ``dtype``."""
        inv_freq = self.inv_freq(positions.device)[None, :]  # [1, R/2]
        if self._long_inv_freq is not None:
            self._long_inv_freq = self._long_inv_freq.to(positions.device)
            inv_freq = torch.where((positions >= self.long_from)[:, None], self._long_inv_freq[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, R] (R <= D) -> [T, H, D]: the first R channels rotated."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
