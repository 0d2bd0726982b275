"""Weight-only quantised linears for the CPU (``--weight-dtype``).

Decode on a CPU streams every weight once per step, so its speed is the bytes per token
over the memory bandwidth. SmolLM2-135M in float32 reads 538 MB a token; its default GGUF
already holds the decoder weights in 4 bits (Q4_1) and the embedding in 8 (Q8_0). These
modules keep the weights that small in memory and multiply with PyTorch's weight-packed
CPU kernels (oneDNN / ATen), which take bfloat16 activations:

* ``int4``: ``aten._weight_int4pack_mm_for_cpu``; groups of ``group_size`` (32) along the
  input dimension, each with a bfloat16 scale and zero point: w = (q - 8) * scale + zero,
  q in 0..15. A group quantised by its min / max (llama.cpp's Q4_1: w = d * q + m, d =
  (max - min) / 15, m = min) is the same code with scale = d, zero = m + 8 d, so a Q4_1
  checkpoint's dequantised weights come back as their own codes (only the scales round to
  bfloat16).
* ``int8``: ``aten._weight_int8pack_mm``; symmetric, one bfloat16 scale per output row.
* ``bfloat16``: the weights in bfloat16.

Activations stay in the model's dtype between the linears (norms, RoPE, attention and the
residual stream in float32); each linear casts its input to bfloat16 and its output back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["QuantLinear", "quantize_linears", "gguf_weight_dtype", "resolve_weight_dtype"]

INT4_GROUP_SIZE = 32  # llama.cpp's Q4_0 / Q4_1 block


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W stored as ``kind`` ("int4", "int8" or "bfloat16").

    x [..., in_features] in any float dtype -> [..., out_features] in x's dtype. The
    product runs in bfloat16 with float32 accumulation. Built by ``from_linear``; raises
    ValueError for a shape the kind's kernel cannot take (int4: out_features a multiple
    of 16, in_features of the group size)."""

    def __init__(self, kind: str, in_features: int, out_features: int, bias: torch.Tensor | None,
                 weight: torch.Tensor, scales: torch.Tensor | None, group_size: int = 0) -> None:
        super().__init__()
        self.kind, self.in_features, self.out_features, self.group_size = kind, in_features, out_features, group_size
        self.register_buffer("qweight", weight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, layer: nn.Linear, kind: str, group_size: int = INT4_GROUP_SIZE) -> QuantLinear:
        w = layer.weight.detach().float()  # [N, K]
        n, k = w.shape
        bias = getattr(layer, "bias", None)  # an nn.Embedding (a tied LM head) has none
        bias = None if bias is None else bias.detach().clone()
        if kind == "bfloat16":
            return cls(kind, k, n, bias, w.to(torch.bfloat16).contiguous(), None)
        if kind == "int8":
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
            q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
            return cls(kind, k, n, bias, q.contiguous(), scale.to(torch.bfloat16))
        if kind != "int4":
            raise ValueError(f"unknown weight kind {kind!r}")
        if n % 16 or k % group_size:
            raise ValueError(f"int4 needs out_features % 16 == 0 and in_features % {group_size} == 0, got {n} x {k}")
        groups = w.reshape(n, k // group_size, group_size)
        low = groups.amin(dim=-1, keepdim=True)
        step = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low) / step).clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale_zero = torch.stack([step.reshape(n, -1), (low + 8 * step).reshape(n, -1)], dim=-1)  # [N, G, 2]
        return cls(kind, k, n, bias, packed, scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16), group_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes read per forward (weights and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales) if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, self.group_size, self.scales)
        elif self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            y = torch.nn.functional.linear(rows, self.qweight)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}{group}"


def quantize_linears(model: nn.Module, kind: str, lm_head_kind: str | None = None) -> dict[str, Any]:
    """Replace every ``nn.Linear`` of the decoder layers with a ``QuantLinear`` of ``kind``,
    and give the LM head one of ``lm_head_kind`` (default ``kind``; int4 falls back to int8
    for any weight whose shape the int4 kernel cannot take) as ``model.lm_head_quant``
    (the embedding table itself stays for the lookup). Returns a summary: linears replaced,
    bytes of their weights before and after."""
    before = after = replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                layer_kind = "int8" if kind == "int4" and not _int4_fits(child.weight) else kind
                quant = QuantLinear.from_linear(child, layer_kind)
                before += child.weight.numel() * child.weight.element_size()
                after += quant.weight_bytes
                setattr(parent, name, quant)
                replaced += 1
    head = getattr(model, "lm_head", None)
    if head is not None:
        head_kind = lm_head_kind or kind
        if head_kind == "int4" and not _int4_fits(head.weight):
            head_kind = "int8"
        model.lm_head_quant = QuantLinear.from_linear(head, head_kind)
        before += head.weight.numel() * head.weight.element_size()
        after += model.lm_head_quant.weight_bytes
    return {"linears": replaced, "bytes_before": before, "bytes_after": after}


def _int4_fits(weight: torch.Tensor) -> bool:
    """Whether the int4 kernel takes a [N, K] weight (a tensor-parallel shard may not)."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % INT4_GROUP_SIZE == 0


_GGUF_KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8",
               "Q6_K": "int8", "Q8_0": "int8", "BF16": "bfloat16", "F16": "bfloat16"}


def resolve_weight_dtype(weight_dtype: str, model_path: str | None, device: torch.device) -> tuple[str, str]:
    """``--weight-dtype`` -> (decoder linears' kind, LM head's kind), "model" meaning no
    conversion. ``model_path`` is the server's (None: the default GGUF). Raises ValueError
    for a quantised kind off the CPU (the packed kernels used here are the CPU ones)."""
    if weight_dtype == "model" or (weight_dtype == "auto" and device.type != "cpu"):
        return "model", "model"
    if device.type != "cpu":
        raise ValueError(f"--weight-dtype {weight_dtype} runs on the CPU only (use 'model' or 'auto' on {device.type})")
    if weight_dtype != "auto":
        return weight_dtype, weight_dtype
    from radixlm.runtime.executor.model_loader import default_gguf_path

    path = str(default_gguf_path()) if model_path is None else model_path
    stored = gguf_weight_dtype(path) if path.endswith(".gguf") else None
    return stored or ("model", "model")


def gguf_weight_dtype(path: str) -> tuple[str, str] | None:
    """(decoder linears' kind, embedding's kind) a GGUF file stores its weights in, read
    from its tensor table (no data is loaded): the kinds of ``QuantLinear`` that hold
    them without growing them (4-bit -> int4; 5- to 8-bit -> int8; 16-bit -> bfloat16);
    None for a float32 file or types not listed."""
    import gguf

    reader = gguf.GGUFReader(path)
    linear = embed = None
    for tensor in reader.tensors:
        kind = _GGUF_KINDS.get(tensor.tensor_type.name)
        if tensor.name in ("token_embd.weight", "output.weight"):
            embed = kind if embed is None or tensor.name == "output.weight" else embed
        elif tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len(tensor.shape) == 2:
            linear = linear or kind
    return (linear, embed or linear) if linear else None
