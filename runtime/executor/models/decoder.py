"""The decoder every model family shares, in plain PyTorch over a paged KV cache.

Dimension letters: T new tokens in the pass, N rows whose logits are wanted, E hidden size,
F MLP intermediate size, H query heads, K kv heads, D head dim, V vocab size, X experts.

Per layer (``[...]``: only where the family's ``DecoderSpec`` says so)::

    x -> RMSNorm -> qkv_proj -> [q/k RMSNorm per head] -> RoPE(q, k)
      -> attn_backend (stores k/v; the layer's scale, [soft-cap], [sliding window])
      -> o_proj -> [post-attention RMSNorm] -> +x
      -> RMSNorm -> MLP (gated: act(gate) * up -> down; or a sparse MoE block)
      -> [post-feedforward RMSNorm] -> +x

q/k/v projections are one matmul (``qkv_proj``) and gate/up one (``gate_up_proj``);
``load_weights`` maps checkpoint names onto them (separate q/k/v and gate/up tensors, or
Phi-3's already fused ones, or per-expert MoE tensors onto ``[X, ...]`` expert stacks).
A family is a ``CausalLM`` subclass that sets the spec and, where needed, overrides
``layer_spec`` (per-layer attention settings and RoPE); see ``models/__init__.py``.

With the Triton attention backend and a spec the fused kernels cover (``DecoderSpec.fusable``:
no sandwich norms, no embedding scale, SiLU), layers run the fused add + RMSNorm, RoPE and
SiLU-and-mul kernels with the residual stream kept apart (vLLM's layout), and at batch 1 on
CUDA fold them into the projections' GEMVs; other specs run the plain path over the same
attention backend.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.executor.attention import (
    AttentionBackend,
    LayerAttention,
    TritonAttentionBackend,
)
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.models.layers import (
    ACTIVATIONS,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    rope_parameters,
)
from radixlm.runtime.executor.models.layers import softcap as soft_cap
from radixlm.runtime.executor.models.moe import SparseMoeBlock, moe_spec
from radixlm.runtime.memory.kv_pool import KVPool

__all__ = ["CausalLM", "DecoderSpec", "LayerSpec", "head_dim", "local_heads", "rope_key", "sliding_window"]

# Checkpoint name fragment -> (our merged parameter fragment, shard index).
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# Per-expert checkpoint tensors: ...mlp.experts.<e>.<gate_proj|up_proj|down_proj>.weight
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")  # vocabulary rows (vocab-parallel)
_EXPERT_TARGET = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """What a family changes in the shared decoder (all off: Llama).

    qkv_bias: biases on q/k/v (Qwen2). qk_norm: RMSNorm over D of each q and k head
    before RoPE (Qwen3, Gemma 3). sandwich_norms: RMSNorm on the attention output and on the
    MLP output before each residual add, the pre-MLP norm named ``pre_feedforward_layernorm``
    (Gemma 2/3). norm_offset: added to every checkpoint norm weight (Gemma's ``x̂ (1 + w)``
    norms: 1.0). embed_scale: embeddings times this, cast to the model dtype first (Gemma:
    sqrt(E)). activation: the gated MLP's ``ACTIVATIONS`` name. final_softcap: logits ->
    cap * tanh(logits / cap) (Gemma 2).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    norm_offset: float = 0.0
    embed_scale: float | None = None
    activation: str = "silu"
    final_softcap: float | None = None

    @property
    def fusable(self) -> bool:
        """Whether the fused Triton layer path computes this spec."""
        return not self.sandwich_norms and self.embed_scale is None and self.activation == "silu"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's attention settings, RoPE parameters and whether its MLP is a MoE block."""

    attention: LayerAttention
    rope: tuple[tuple[str, Any], ...]  # rope_parameters(...) items, hashable: layers share tables
    moe: bool = False


class Attention(nn.Module):
    """QKV projection, [q/k norm], RoPE, paged attention through the backend, output projection."""

    def __init__(self, config: Any, layer_id: int, backend: AttentionBackend, spec: DecoderSpec,
                 rotary: RotaryEmbedding, settings: LayerAttention, tp: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.rotary = [rotary]  # a list: not a registered submodule (no parameters)
        self.layer_id = layer_id
        self.attn_backend = backend
        backend.set_layer(layer_id, settings)
        self.tp = tp  # a TPGroup (executor/parallel.py) with tensor parallelism: this rank's heads
        self.num_heads, self.num_kv_heads = local_heads(config, tp)
        self.head_dim = head_dim(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(self, x: torch.Tensor, tables: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
                batch: ForwardBatch, pool: KVPool) -> torch.Tensor:  # fmt: skip
        """x [T, E] -> [T, E]; stores this layer's new K/V into ``pool``. ``tables``: cos / sin
        per rotary (``DecoderModel.rope_tables``), or None on the fused path (in-place RoPE
        at ``batch.positions``)."""
        fused = tables is None
        cos_sin = None if fused else tables[id(self.rotary[0])]
        return self.attend(_linear(self.qkv_proj, x, fused), cos_sin, batch, pool)

    def attend(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, batch: ForwardBatch,
               pool: KVPool, kv_stored: bool = False) -> torch.Tensor:  # fmt: skip
        """``forward`` after the QKV projection: qkv [T, (H + 2K) * D] -> [T, E].
        ``cos_sin`` None: the fused path (in-place q/k norm and RoPE). ``kv_stored``: the
        projection already applied RoPE and wrote K / V into the pool (``rope_store``)."""
        q, k, v = self.heads(qkv)
        # Quantised pools store keys rotated (KVPool doc, "Key rotation"): the fused RoPE
        # kernel applies the rotation in the same launch, the PyTorch path after RoPE.
        if cos_sin is None and not kv_stored:
            self.qk_norm_(q, k)
            self.rope_(q, k, batch.positions, pool)
        elif cos_sin is not None:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = pool.rotate_qk(apply_rope(q, *cos_sin), apply_rope(k, *cos_sin))
        o = self.attn_backend.forward(q, k, v, self.layer_id, batch, pool, kv_stored=kv_stored)  # [T, H, D]
        out = _linear(self.o_proj, o.reshape(qkv.shape[0], -1), cos_sin is None)  # [T, H*D] -> [T, E]
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel: the ranks' partial sums

    def project_out(self, o: torch.Tensor, fused: bool) -> torch.Tensor:
        """o_proj: o [T, H * D] -> [T, E], summed over the ranks with tensor parallelism
        (row-parallel: each rank's heads give a partial sum)."""
        out = _linear(self.o_proj, o, fused)
        return out if self.tp is None else self.tp.all_reduce(out)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2K) * D] -> views q [T, H, D], k [T, K, D], v [T, K, D]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)  # [T, H*D], [T, K*D] x2
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))  # fmt: skip

    def qk_norm_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """The per-head q / k RMSNorm in place (q [T, H, D], k [T, K, D] views); no-op without."""
        if self.qk_norm:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))

    def rope_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, pool: KVPool) -> None:
        """RoPE (and the pool's key rotation) on q / k in place; positions [T] int64. The
        fused kernel where the rotary is ``fusable``, else the PyTorch tables."""
        rotary = self.rotary[0]
        if rotary.fusable:
            _fused_ops().rotary_embedding_(q, k, positions, rotary.inv_freq(q.device), pool.qk_rotation)
            return
        cos, sin = rotary(positions, q.dtype)
        q_rot, k_rot = pool.rotate_qk(apply_rope(q, cos, sin), apply_rope(k, cos, sin))
        q.copy_(q_rot)
        k.copy_(k_rot)

    def rope_store(self, x: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> Any:
        """The QKV GEMV's RoPE + KV-write epilogue (``kernels.gemv.RopeStore``) for this
        layer, or None where it does not apply: it needs the batch-1 GEMV path, a decode
        token, a fusable rotary without q/k norm, and a plain float pool in the model's dtype
        (no FP8 / INT4 pages, key rotation or attention sink)."""
        k_pool = pool.k[self.layer_id]
        if not (_gemv_ok(self.qkv_proj, x) and batch.is_decode and not pool.quantised and not pool.tiered
                and pool.qk_rotation is None and not pool.has_sink and k_pool.dtype == x.dtype
                and k_pool.is_contiguous() and pool.v[self.layer_id].is_contiguous()
                and self.rotary[0].fusable and not self.qk_norm):  # fmt: skip
            return None
        from radixlm.kernels.gemv import RopeStore

        return RopeStore(batch.positions, self.rotary[0].inv_freq(x.device), batch.out_slots, k_pool,
                         pool.v[self.layer_id], self.num_heads)  # fmt: skip


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) (SwiGLU for SiLU, GeGLU for GELU; Shazeer, "GLU Variants
    Improve Transformer", 2020), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", fused: bool = False,
                 tp: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp  # tensor parallelism: intermediate_size is this rank's share, down is summed
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[activation]
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down(_linear(self.gate_up_proj, x, True))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, F] each
        out = self.down_proj(self.act(gate) * up)  # [T, E]
        return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel: summed over the ranks

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The fused path after gate_up: [T, 2F] -> down(silu(gate) * up) [T, E]; at batch 1
        on CUDA the activation runs inside the down GEMV (kernels/gemv.py)."""
        if _gemv_ok(self.down_proj, gate_up):
            from radixlm.kernels.gemv import silu_mul_gemv

            out = silu_mul_gemv(gate_up, self.down_proj.weight)
        else:
            out = _linear(self.down_proj, _fused_ops().silu_and_mul(gate_up), True)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, backend: AttentionBackend, spec: DecoderSpec,
                 layer: LayerSpec, rotary: RotaryEmbedding, fused: bool, tp: Any = None) -> None:  # fmt: skip
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_id, backend, spec, rotary, layer.attention, tp)
        if layer.moe:
            if tp is not None:
                raise ValueError("tensor parallelism does not cover MoE layers yet (no expert sharding)")
            self.mlp: nn.Module = SparseMoeBlock(moe_spec(config), config.hidden_size)
        else:
            width = config.intermediate_size if tp is None else tp.split(config.intermediate_size, "the MLP width")[1]
            self.mlp = GatedMLP(config.hidden_size, width, spec.activation, fused, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:  # Gemma 2/3: post_attention_layernorm normalises the attention output
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm in front of the MLP."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x: torch.Tensor, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], batch: ForwardBatch,
                pool: KVPool) -> torch.Tensor:  # fmt: skip
        """The plain path: x [T, E] -> [T, E]."""
        h = self.self_attn(self.input_layernorm(x), tables, batch, pool)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.sandwich:
            h = self.post_feedforward_layernorm(h)
        return x + h

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, pool: KVPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with fused kernels, residual stream kept apart (vLLM's layout):
        (x, residual) -> (this layer's MLP output, residual so far); the sum of the two is
        what ``forward`` returns. ``residual`` None at the first layer."""
        rope = self.self_attn.rope_store(x, batch, pool)
        qkv, residual = self.qkv_fused(x, residual, rope)
        h = self.self_attn.attend(qkv, None, batch, pool, kv_stored=rope is not None)
        return self.mlp_fused(h, residual)

    def qkv_fused(self, x: torch.Tensor, residual: torch.Tensor | None, rope_store: Any = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer up to its attention: (x, residual) [T, E] -> (qkv [T, (H + 2K) * D]
        before q/k norm and RoPE unless ``rope_store`` (``_norm_linear``), residual so far);
        ``residual`` None at the first layer."""
        return _norm_linear(self.self_attn.qkv_proj, x, residual, self.input_layernorm, rope_store)

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer after its attention: (o [T, H * D], residual [T, E]) -> (the MLP
        output, residual so far): the output projection, then ``mlp_fused``."""
        return self.mlp_fused(self.self_attn.project_out(o, True), residual)

    def mlp_fused(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused layer after its attention's output projection: (h, residual) [T, E] ->
        (the MLP output, residual so far)."""
        if isinstance(self.mlp, SparseMoeBlock):
            norm = self.mlp_norm
            x, residual = _fused_ops().fused_add_rmsnorm(h, residual, norm.weight, norm.eps)
            return self.mlp(x), residual
        gate_up, residual = _norm_linear(self.mlp.gate_up_proj, h, residual, self.mlp_norm)
        return self.mlp.down(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend, spec: DecoderSpec, layers: list[LayerSpec],
                 tp: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.tp, self.vocab_size = tp, config.vocab_size
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:  # this rank's rows of the vocabulary, padded (TPShard.vocab)
            self.embed_tokens = nn.Embedding(tp.vocab(config.vocab_size)[2], config.hidden_size)
        self.embed_scale = spec.embed_scale
        # One rotary per distinct parameter set (Gemma 3: local and global); plain objects.
        self.rotaries: dict[tuple, RotaryEmbedding] = {}
        for layer in layers:
            if layer.rope not in self.rotaries:
                self.rotaries[layer.rope] = RotaryEmbedding(head_dim(config), dict(layer.rope))
        # Fused Triton norm / RoPE / SiLU kernels go with the Triton attention backend.
        self.fused = isinstance(backend, TritonAttentionBackend) and spec.fusable
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, spec, layer, self.rotaries[layer.rope], self.fused, tp)
            for i, layer in enumerate(layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        """The first layer's rotary (the only one for most families)."""
        return self.layers[0].self_attn.rotary[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, E], times the family's embedding scale (in the model dtype).
        With tensor parallelism each rank looks up the ids in its vocabulary slice (zero
        elsewhere) and the ranks' rows are summed."""
        if self.tp is None:
            x = self.embed_tokens(input_ids)
        else:
            start, rows, _ = self.tp.vocab(self.vocab_size)
            mine = (input_ids >= start) & (input_ids < start + rows)  # [T]
            x = self.embed_tokens(torch.where(mine, input_ids - start, 0))
            x = self.tp.all_reduce(x * mine[:, None].to(x.dtype))
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """id(rotary) -> (cos, sin) [T, R] for the plain path, once per pass."""
        return {id(r): r(positions, dtype) for r in self.rotaries.values()}

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """All layers over the batch's new tokens; returns normed hidden states [N, E] of
        ``batch.logits_rows`` (the norm is per row, so only those rows are normed)."""
        x = self.embed(batch.input_ids)  # [T, E]
        if self.fused:
            residual = None
            for layer in self.layers:
                pool.await_loads(layer.self_attn.layer_id)  # its pages of a host-tier load in flight
                x, residual = layer.forward_fused(x, residual, batch, pool)
            if not batch.logits_all:
                x, residual = x[batch.logits_rows], residual[batch.logits_rows]
            return _fused_ops().fused_add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]
        tables = self.rope_tables(batch.positions, x.dtype)
        for layer in self.layers:
            pool.await_loads(layer.self_attn.layer_id)  # before the layer writes or reads its pages
            x = layer(x, tables, batch, pool)
        return self.norm(x if batch.logits_all else x[batch.logits_rows])  # [N, E]


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states, ``compute_logits`` the logits.

    A family subclasses it: ``decoder_spec(config)`` (class-wide differences), ``layer_spec``
    (per layer: sliding window, RoPE, MoE), ``checkpoint_renames`` (regex, replacement pairs
    applied to checkpoint names first).
    """

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: Any, attn_backend: AttentionBackend, tp: Any = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        self.tp = tp  # a TPShard / TPGroup (executor/parallel.py): this rank's slice; None: the whole model
        self.spec = self.decoder_spec(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        layers = [self.layer_spec(config, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, attn_backend, self.spec, layers, tp)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            rows = config.vocab_size if tp is None else tp.vocab(config.vocab_size)[2]
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self._renames = [(re.compile(p), r) for p, r in self.checkpoint_renames]

    # ------------------------------------------------------------------ family hooks
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        """The family's ``DecoderSpec`` (Llama: the defaults)."""
        return DecoderSpec()

    @classmethod
    def layer_spec(cls, config: Any, layer_id: int) -> LayerSpec:
        """Layer ``layer_id``: the config's sliding window where the layer is a sliding one
        (``config.layer_types``; every layer when the config has a window and no types),
        the config's RoPE, a dense MLP."""
        return LayerSpec(LayerAttention(window=sliding_window(config, layer_id)), rope_key(config))

    # --------------------------------------------------------------------- forward
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Run the batch (writing its K/V into ``pool``) -> hidden states [N, E] of
        ``batch.logits_rows``, in the model dtype."""
        self.attn_backend.prepare(batch, pool)
        return self.model(batch, pool)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, E] -> logits [N, V] float32 (soft-capped where the family caps them),
        written into ``out`` [N, V] float32 if given (the decode CUDA graphs' shared buffer)
        and returned."""
        head = getattr(self, "lm_head_quant", None)  # --weight-dtype (executor/weight_quant.py)
        logits = head(hidden) if head is not None else F.linear(hidden, self.lm_head.weight)
        if self.tp is not None:  # [N, Vp] per rank -> [N, V]: sampling sees the whole vocabulary
            logits = self.tp.all_gather_columns(logits, self.config.vocab_size)
        if self.spec.final_softcap is not None:
            logits = soft_cap(logits.float(), self.spec.final_softcap)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the (merged) parameters, then add the family's norm
        offset to every RMSNorm weight.

        Raises ValueError on an unknown name, a shape mismatch or a missing tensor.
        """
        params = dict(self.named_parameters())
        missing = {key for name in params for key in self._expected_keys(name, params[name])}
        for name, tensor in weights:
            if "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard = self._locate(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            dst = params[target].data
            if shard is not None:
                dst = self._shard(target, dst, shard)
            if self.tp is not None and target in _VOCAB_PARAMS:  # the last rank's slice: padded
                dst[tensor.shape[0] :].zero_()
                dst = dst[: tensor.shape[0]]
            if dst.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
            dst.copy_(tensor)
            if shard is None:  # a whole parameter (fused checkpoint tensors) covers its shards
                missing -= {key for key in missing if key[0] == target}
            missing.discard((target, shard))
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(map(str, missing))[:8]}")
        if self.spec.norm_offset:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data += self.spec.norm_offset

    def checkpoint_slice(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor ``name`` (of ``shape``) this rank loads (None: all
        of it); the loader reads only that (``safe_open(...).get_slice``). Column-parallel
        weights (q/k/v and their biases, gate/up, embedding, LM head) by rows, row-parallel
        ones (o_proj, down) by columns, the rest (norms) whole (parallel.py's table)."""
        tp = self.tp
        if tp is None:
            return None
        target, shard = self._locate(name)
        if isinstance(shard, tuple) or (shard is None and (".qkv_proj." in target or ".gate_up_proj." in target)):
            raise ValueError(f"{name}: tensor parallelism needs separate q/k/v and gate/up tensors "
                             f"(not fused or per-expert ones)")
        cfg, d = self.config, head_dim(self.config)
        if ".qkv_proj." in target:
            first, count = (tp.q_heads(cfg.num_attention_heads) if shard == 0
                            else tp.kv_heads(cfg.num_attention_heads, cfg.num_key_value_heads))
            return (slice(first * d, (first + count) * d),)
        if ".gate_up_proj." in target:
            start, count = tp.split(shape[0], "the MLP width")
            return (slice(start, start + count),)
        if target.endswith(".o_proj.weight"):
            first, count = tp.q_heads(cfg.num_attention_heads)
            return (slice(None), slice(first * d, (first + count) * d))
        if target.endswith(".down_proj.weight"):
            start, count = tp.split(shape[1], "the MLP width")
            return (slice(None), slice(start, start + count))
        if target in _VOCAB_PARAMS:
            start, rows, _ = tp.vocab(shape[0])
            return (slice(start, start + rows),)
        return None

    def _locate(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (our parameter name, shard within it or None). Shards: an int
        (rows of a merged qkv / gate_up) or (expert, int | None) (an expert stack's slice)."""
        for pattern, repl in self._renames:
            name = pattern.sub(repl, name)
        expert = _EXPERT.match(name)
        if expert:
            param, shard = _EXPERT_TARGET[expert.group(3)]
            return f"{expert.group(1)}.{param}", (int(expert.group(2)), shard)
        for fragment, (merged, shard) in _STACKED.items():
            if fragment in name:
                return name.replace(fragment, merged), shard
        return name, None

    @staticmethod
    def _expected_keys(name: str, param: torch.Tensor) -> list[tuple[str, Any]]:
        """(name, shard) pairs a checkpoint must provide for one of our parameters (per-expert
        and separate q/k/v, gate/up tensors; a whole fused tensor covers them as well)."""
        if name.endswith(".experts.gate_up_proj"):
            return [(name, (e, s)) for e in range(param.shape[0]) for s in range(2)]
        if name.endswith(".experts.down_proj"):
            return [(name, (e, None)) for e in range(param.shape[0])]
        if ".qkv_proj." in name:
            return [(name, s) for s in range(3)]
        if ".gate_up_proj." in name:
            return [(name, s) for s in range(2)]
        return [(name, None)]

    def _shard(self, target: str, dst: torch.Tensor, shard: Any) -> torch.Tensor:
        """The view of merged parameter ``target`` (``dst``) that holds ``shard``."""
        if isinstance(shard, tuple):  # expert stack [X, rows, cols]
            expert, part = shard
            dst = dst[expert]
            if part is None:
                return dst
            half = dst.shape[0] // 2  # gate_up [2F, E]: gate rows then up rows
            return dst[part * half : (part + 1) * half]
        if ".qkv_proj." in target:
            sizes = self.model.layers[0].self_attn.split_sizes  # [H*D, K*D, K*D]
        else:
            sizes = [dst.shape[0] // 2] * 2  # [F, F]
        start = sum(sizes[:shard])
        return dst[start : start + sizes[shard]]


def sliding_window(config: Any, layer_id: int) -> int | None:
    """The sliding window of layer ``layer_id`` per config.json (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and types[layer_id] != "sliding_attention"):
        return None
    return int(window)


def rope_key(config: Any, layer_type: str | None = None) -> tuple[tuple[str, Any], ...]:
    """``rope_parameters(config, layer_type)`` as a hashable key (lists as tuples): layers
    with equal keys share one ``RotaryEmbedding``."""
    params = rope_parameters(config, layer_type)
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


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


def local_heads(config: Any, tp: Any = None) -> tuple[int, int]:
    """(H, K): the query and kv heads this rank computes (all of them without ``tp``)."""
    if tp is None:
        return config.num_attention_heads, config.num_key_value_heads
    return tp.q_heads(config.num_attention_heads)[1], tp.kv_heads(config.num_attention_heads,
                                                                   config.num_key_value_heads)[1]


def head_dim(config: Any) -> int:
    """D: ``config.head_dim`` where set, else E / H."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

