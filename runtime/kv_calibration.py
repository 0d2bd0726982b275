"""FP8 KV-cache scales: calibration on bundled text, and the scales file.

An FP8 (e4m3) KV pool stores ``clamp(x / scale, +-448)`` with one float32 scale per layer
and kv head, for K and for V (``radixlm.kernels.reference.quantize_fp8``). The scales come
from the data, never a default of 1.0:

* ``calibrate_kv_scales``: one prefill of ``data/kv_calibration.txt`` (~1.6K tokens of
  chat-formatted prose, code, lists and numbers) through the model with a float KV pool;
  ``scale = margin x absmax / 448`` per (layer, kv head) over the stored K/V. The margin
  (default 2) leaves one binade of headroom for activations larger than any seen in the
  calibration text; e4m3 keeps 3 mantissa bits at every magnitude down to 2^-6 x scale,
  so the headroom costs no precision for values above that.
* ``save_kv_scales`` / ``load_kv_scales``: JSON ``{"format": "radixlm-kv-scales-v1",
  "num_layers": L, "num_kv_heads": K, "k_scale": [[...] x L], "v_scale": [[...] x L]}``.

Any scale that is missing, non-finite or <= 0 is an error (``KVScalesError``): the server
refuses to start rather than quantise with a made-up scale.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from radixlm.kernels.reference import FP8_E4M3_MAX
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool

__all__ = [
    "CALIBRATION_TEXT",
    "KVScalesError",
    "calibrate_kv_scales",
    "load_kv_scales",
    "save_kv_scales",
]

CALIBRATION_TEXT = Path(__file__).parent / "data" / "kv_calibration.txt"
FORMAT = "radixlm-kv-scales-v1"


class KVScalesError(ValueError):
    """FP8 KV scales are missing or unusable (the message says which and why)."""


@torch.inference_mode()
def calibrate_kv_scales(
    model: Any,
    token_ids: list[int],
    page_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    margin: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``token_ids`` as one prefill through ``model`` (a ``LlamaForCausalLM``) with a
    float pool of ``dtype`` and return (k_scales, v_scales), each [L, K] float32 on the
    CPU: ``margin * absmax / 448`` of the stored keys / values per layer and kv head.

    Raises KVScalesError when the text is empty or a head's absmax is 0 or not finite.
    """
    if not token_ids:
        raise KVScalesError("KV scale calibration needs at least one token")
    cfg = model.config
    num_layers, num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_pages = -(-len(token_ids) // page_size)
    pool = KVPool(num_pages + 1, page_size, num_layers, num_kv_heads, head_dim, dtype, device)
    pages = list(range(1, num_pages + 1))
    batch = ForwardBatch.build([token_ids], [0], [pages], [len(token_ids) - 1], page_size, device)
    model.forward(batch, pool)
    n = len(token_ids)

    def absmax(pages_kv: torch.Tensor) -> torch.Tensor:  # [P, S, K, D] -> [K]
        tokens = pages_kv[1:].reshape(-1, num_kv_heads, head_dim)[:n]  # [n, K, D]
        return tokens.float().abs().amax(dim=(0, 2)).cpu()

    k_amax = torch.stack([absmax(pool.k[layer]) for layer in range(num_layers)])  # [L, K]
    v_amax = torch.stack([absmax(pool.v[layer]) for layer in range(num_layers)])
    for name, amax in (("K", k_amax), ("V", v_amax)):
        bad = ~torch.isfinite(amax) | (amax <= 0)
        if bool(bad.any()):
            layer, head = (int(i) for i in bad.nonzero()[0])
            raise KVScalesError(
                f"KV calibration gave an unusable {name} absmax {float(amax[layer, head])} "
                f"(layer {layer}, kv head {head}); pass --kv-scales-path with measured scales"
            )
    return k_amax * margin / FP8_E4M3_MAX, v_amax * margin / FP8_E4M3_MAX


def save_kv_scales(path: str | Path, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """Write [L, K] scales as the JSON format of this module."""
    num_layers, num_kv_heads = k_scales.shape
    doc = {
        "format": FORMAT,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "k_scale": k_scales.tolist(),
        "v_scale": v_scales.tolist(),
    }
    Path(path).write_text(json.dumps(doc))


def load_kv_scales(
    path: str | Path, num_layers: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read (k_scales, v_scales) [L, K] float32 from ``path``.

    Raises KVScalesError naming the problem: unreadable file, not this format, a shape
    other than the model's (layers, kv heads), or a scale that is not finite and > 0.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KVScalesError(f"--kv-scales-path {path}: cannot read JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KVScalesError(f"--kv-scales-path {path}: not a {FORMAT} file")
    out = []
    for key in ("k_scale", "v_scale"):
        rows = doc.get(key)
        ok = (
            isinstance(rows, list)
            and len(rows) == num_layers
            and all(isinstance(r, list) and len(r) == num_kv_heads for r in rows)
        )
        if not ok:
            raise KVScalesError(
                f"--kv-scales-path {path}: {key} must be {num_layers} lists of {num_kv_heads} "
                "numbers (the model's layers x kv heads)"
            )
        values = [v for r in rows for v in r]
        if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values):
            raise KVScalesError(f"--kv-scales-path {path}: every {key} must be a finite number > 0")
        out.append(torch.tensor(rows, dtype=torch.float32))
    return out[0], out[1]
