"""Llama (and Qwen2) decoder in plain PyTorch, over a paged KV cache.

Dimension letters: T new tokens in the pass, N rows whose logits are wanted, E hidden size,
F MLP intermediate size, H query heads, K kv heads, D head dim, V vocab size.

Per layer::

    x -> RMSNorm -> qkv_proj -> RoPE(q, k) -> attn_backend (stores k/v, paged attention)
      -> o_proj -> +x -> RMSNorm -> gate_up_proj -> SiLU(gate) * up -> down_proj -> +x

q/k/v projections are merged into one matmul (``qkv_proj``) and gate/up into one
(``gate_up_proj``); ``load_weights`` maps Hugging Face checkpoint names onto them.
RoPE uses the Hugging Face (GPT-NeoX, rotate-half) layout with "default", "linear" and
"llama3" frequency scaling. Qwen2 is Llama with biases on q/k/v.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.executor.attention import AttentionBackend, TritonAttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.memory.kv_pool import KVPool

__all__ = ["LlamaForCausalLM", "Qwen2ForCausalLM", "RMSNorm", "RotaryEmbedding", "rope_parameters"]

# HF checkpoint name fragment -> (our merged parameter fragment, shard index).
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like Hugging Face."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, E] -> [T, E], same dtype."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    Reads ``config.rope_parameters`` (transformers >= 5) or ``config.rope_scaling`` +
    ``config.rope_theta`` (older).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
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


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """[D/2] float32 inverse frequencies on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the new tokens' positions (rotate-half layout)."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        # A plain attribute, not a buffer: built on the CPU even under a meta-device
        # context, moved to the compute device on first use.
        self._inv_freq = _inv_freq(head_dim, params)  # [D/2] float32

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[D/2] float32 inverse frequencies on ``device``."""
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D] in ``dtype``."""
        self.inv_freq(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> rotated [T, H, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, backend: AttentionBackend, qkv_bias: bool,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.rotary = [rotary]  # fused RoPE's frequencies (a list: not a registered submodule)
        self.layer_id = layer_id
        self.attn_backend = backend
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        """x [T, E] -> [T, E]; stores this layer's new K/V into ``pool``. With cos / sin
        None, RoPE is the fused in-place kernel at ``batch.positions``."""
        return self.attend(_linear(self.qkv_proj, x, cos is None), cos, sin, batch, pool)

    def attend(
        self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, batch: ForwardBatch,
        pool: KVPool, kv_stored: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """``forward`` after the QKV projection: qkv [T, (H + 2K) * D] -> [T, E].
        ``kv_stored``: the projection already applied RoPE and wrote K / V into the pool
        (``rope_store``)."""
        fused = cos is None
        q, k, v = self.heads(qkv)
        # Quantised pools store keys rotated (KVPool doc, "Key rotation"): the fused RoPE
        # kernel applies the rotation in the same launch, the PyTorch path after RoPE.
        if cos is None and not kv_stored:
            self.rope_(q, k, batch.positions, pool)
        elif cos is not None:
            q, k = pool.rotate_qk(apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        o = self.attn_backend.forward(q, k, v, self.layer_id, batch, pool, kv_stored=kv_stored)  # [T, H, D]
        return _linear(self.o_proj, o.reshape(qkv.shape[0], -1), fused)  # [T, H*D] -> [T, E]

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2K) * D] -> views q [T, H, D], k [T, K, D], v [T, K, D]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)  # [T, H*D], [T, K*D] x2
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))  # fmt: skip

    def rope_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, pool: KVPool) -> None:
        """The fused RoPE kernel (and the pool's key rotation) on q / k in place; positions [T] int64."""
        _fused_ops().rotary_embedding_(q, k, positions, self.rotary[0].inv_freq(q.device), pool.qk_rotation)

    def rope_store(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> Any:
        """The QKV GEMV's RoPE + KV-write epilogue (``kernels.gemv.RopeStore``) for this
        layer, or None where it does not apply: it needs the batch-1 GEMV path, a decode
        token, and a plain float pool in the model's dtype (no FP8 / INT4 pages, key
        rotation or attention sink)."""
        k_pool = pool.k[self.layer_id]
        if not (_gemv_ok(self.qkv_proj, x) and batch.is_decode and not pool.quantised and not pool.tiered
                and pool.qk_rotation is None and not pool.has_sink and k_pool.dtype == x.dtype
                and k_pool.is_contiguous() and pool.v[self.layer_id].is_contiguous()):  # fmt: skip
            return None
        from radixlm.kernels.gemv import RopeStore

        return RopeStore(batch.positions, self.rotary[0].inv_freq(x.device), batch.out_slots, k_pool,
                         pool.v[self.layer_id], self.num_heads)  # fmt: skip


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, fused: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down(_linear(self.gate_up_proj, x, True))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, F] each
        return self.down_proj(F.silu(gate) * up)  # [T, E]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The fused path after gate_up: [T, 2F] -> down(silu(gate) * up) [T, E]; at batch 1
        on CUDA the activation runs inside the down GEMV (kernels/gemv.py)."""
        if _gemv_ok(self.down_proj, gate_up):
            from radixlm.kernels.gemv import silu_mul_gemv

            return silu_mul_gemv(gate_up, self.down_proj.weight)
        return _linear(self.down_proj, _fused_ops().silu_and_mul(gate_up), True)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, backend: AttentionBackend, qkv_bias: bool,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, backend, qkv_bias, rotary)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, fused=rotary is not None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, pool: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with fused kernels, residual stream kept apart (vLLM's layout):
        (x, residual) -> (this layer's MLP output, residual so far); the sum of the two is
        what ``forward`` returns. ``residual`` None at the first layer."""
        rope = self.self_attn.rope_store(x, batch, pool)
        qkv, residual = self.qkv_fused(x, residual, rope)
        h = self.self_attn.attend(qkv, None, None, batch, pool, kv_stored=rope is not None)
        return self.mlp_fused(h, residual)

    def qkv_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope_store: Any = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer up to its attention: (x, residual) [T, E] -> (qkv [T, (H + 2K) * D]
        before RoPE unless ``rope_store`` (``_norm_linear``), residual so far); ``residual``
        None at the first layer."""
        return _norm_linear(self.self_attn.qkv_proj, x, residual, self.input_layernorm, rope_store)

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer after its attention: (o [T, H * D], residual [T, E]) -> (the MLP
        output, residual so far): the output projection, then ``mlp_fused``."""
        return self.mlp_fused(_linear(self.self_attn.o_proj, o, True), residual)

    def mlp_fused(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer after its attention's output projection: (h, residual) [T, E] ->
        (the MLP output, residual so far)."""
        gate_up, residual = _norm_linear(self.mlp.gate_up_proj, h, residual, self.post_attention_layernorm)
        return self.mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), rope_parameters(config))
        # Fused Triton norm / RoPE / SiLU kernels go with the Triton attention backend.
        self.fused = isinstance(backend, TritonAttentionBackend)
        rotary = self.rotary_emb if self.fused else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, qkv_bias, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """All layers over the batch's new tokens; returns normed hidden states [N, E] of
        ``batch.logits_rows`` (the norm is per row, so only those rows are normed)."""
        x = self.embed_tokens(batch.input_ids)  # [T, E]
        if self.fused:
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_fused(x, residual, batch, pool)
            if not batch.logits_all:
                x, residual = x[batch.logits_rows], residual[batch.logits_rows]
            return _fused_ops().fused_add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]
        cos, sin = self.rotary_emb(batch.positions, x.dtype)  # [T, D] each
        for layer in self.layers:
            x = layer(x, cos, sin, batch, pool)
        return self.norm(x if batch.logits_all else x[batch.logits_rows])  # [N, E]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states, ``compute_logits`` the logits."""

    qkv_bias = False

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, attn_backend, self.qkv_bias)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run the batch (writing its K/V into ``pool``) -> hidden states [N, E] of
        ``batch.logits_rows``, in the model dtype."""
        self.attn_backend.prepare(batch, pool)
        return self.model(batch, pool)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] float32, written into ``out`` [N, V] float32 if
        given (the decode CUDA graphs' shared buffer) and returned."""
        head = getattr(self, "lm_head_quant", None)  # --weight-dtype (executor/weight_quant.py)
        logits = head(hidden) if head is not None else F.linear(hidden, self.lm_head.weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (merged) parameters.

        Raises ValueError on an unknown name, a shape mismatch or a missing tensor.
        """
        params = dict(self.named_parameters())
        missing = {key for name in params for key in self._expected_keys(name)}
        for name, tensor in weights:
            if "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self._locate(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            dst = params[target].data
            if shard is not None:
                dst = dst[self._shard_rows(target, shard)]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            missing.discard((target, shard))
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(map(str, missing))[:8]}")

    @staticmethod
    def _locate(name: str) -> tuple[str, int | None]:
        """HF name -> (our parameter name, shard index within a merged parameter or None)."""
        for fragment, (merged, shard) in _STACKED.items():
            if fragment in name:
                return name.replace(fragment, merged), shard
        return name, None

    @staticmethod
    def _expected_keys(param_name: str) -> list[tuple[str, int | None]]:
        """(name, shard) pairs a checkpoint must provide for one of our parameters."""
        if ".qkv_proj." in param_name:
            return [(param_name, s) for s in range(3)]
        if ".gate_up_proj." in param_name:
            return [(param_name, s) for s in range(2)]
        return [(param_name, None)]

    def _shard_rows(self, target: str, shard: int) -> slice:
        """Rows of merged parameter ``target`` that hold shard ``shard``."""
        if ".qkv_proj." in target:
            sizes = self.model.layers[0].self_attn.split_sizes  # [H*D, K*D, K*D]
        else:
            sizes = [self.config.intermediate_size] * 2  # [F, F]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections (no sliding window support)."""

    qkv_bias = True

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        super().__init__(config, attn_backend)


def _gemv_ok(layer: nn.Linear, x: torch.Tensor) -> bool:
    """Whether the fused path runs ``layer`` on x through kernels/gemv.py: a single row on
    CUDA (batch-1 decode), no bias, K a multiple of 16. There it beats cuBLAS by 1-3 us per
    8B projection on an H200 and takes the RMSNorm / SiLU before it into the same launch."""
    return x.shape[0] == 1 and x.is_cuda and layer.bias is None and x.stride(1) == 1 and layer.in_features % 16 == 0


def _linear(layer: nn.Linear, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``layer(x)`` for x [T, in] -> [T, out]; with the fused kernels, the Triton skinny GEMM
    where ``_gemv_ok``."""
    if fused and _gemv_ok(layer, x):
        from radixlm.kernels.gemv import gemv

        return gemv(x, layer.weight)
    return layer(x)


def _norm_linear(
    layer: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, rope_store: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Fused path: ``(layer(rmsnorm(s)), s)`` with s = x + residual (x when residual is None);
    x, residual [T, E] -> [T, out], [T, E]. One launch where ``_gemv_ok``
    (``kernels.gemv.rmsnorm_gemv``, with ``rope_store`` its QKV epilogue, which the caller
    only passes there), else the fused norm kernel and the linear layer."""
    if _gemv_ok(layer, x) and (residual is None or residual.stride(1) == 1):
        from radixlm.kernels.gemv import rmsnorm_gemv

        return rmsnorm_gemv(x, residual, norm.weight, norm.eps, layer.weight, rope_store=rope_store)
    if rope_store is not None:  # the caller would skip RoPE and the KV write
        raise RuntimeError("rope_store given where the batch-1 GEMV does not run")
    ops = _fused_ops()
    if residual is None:
        return layer(ops.rmsnorm(x, norm.weight, norm.eps)), x
    h, residual = ops.fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
    return layer(h), residual


def _fused_ops() -> Any:
    """radixlm.kernels.fused_ops, imported on first use: triton stays optional for the
    torch backend, and kernel tests can set TRITON_INTERPRET before it is imported."""
    from radixlm.kernels import fused_ops

    return fused_ops


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
