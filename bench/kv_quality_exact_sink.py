"""Experiment: how much of the FP8 KV cache's error comes from the attention sink (position
0)? Runs ``bench/kv_quality.py`` with the torch reference backend changed so that, in FP8
pools, position 0's K/V is read exact (the model's float values, centred like the pages)
instead of from its FP8 page; everything else, including the other 15 keys of that page,
is read from the pool as usual. This emulates an exact sink store: position 0's K/V is a
function of the token id alone (at position 0 a token attends only to itself), so a server
could keep it per first-token id beside the FP8 pages. Such a store is not built; this
script only measures what it would give. Keeping the first tokens' K/V in full precision is
the idea of KVQuant (Hooper et al., 2024, "attention sink-aware" quantisation) and IntactKV
(Liu et al., 2024).

Usage (CPU; same flags as kv_quality.py; ``base`` results are read from the --out
directory's cache when present, so a plain kv_quality.py run there gives the comparison)::

    .venv/bin/python bench/kv_quality.py --dtypes bf16,fp8_e4m3 --tokens 6000 --probe-trials 0 --out A/q.json
    cp A/kv_quality_cpu_bf16_*.pt B/
    .venv/bin/python bench/kv_quality_exact_sink.py --dtypes bf16,fp8_e4m3 --tokens 6000 --probe-trials 0 \\
        --out B/q.json

``KV_SINK_EXACT=0`` runs the same changed backend without the substitution (a check that the
emulation itself reproduces kv_quality.py's numbers; it did, to the last digit, on 300 tokens).
Only single-request batches (kv_quality.py's teacher-forced windows); not the probe.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

import radixlm.runtime.attention as attention
from radixlm.kernels import reference

_plain_forward = attention.TorchAttentionBackend.forward
_exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> position 0's K, V [K, D] float32


def _forward(self, q, k, v, layer_id, batch, pool):
    k_scale = pool.k_scale[layer_id]
    if k_scale is None or pool.tiered:  # float pools, int4 / mixed: unchanged
        return _plain_forward(self, q, k, v, layer_id, batch, pool)
    if len(batch.prefix_lens_cpu) != 1:
        raise SystemExit("kv_quality_exact_sink.py: single-request batches only")
    k_pool, v_pool, v_scale = pool.k[layer_id], pool.v[layer_id], pool.v_scale[layer_id]
    k_mean, v_mean = pool.k_mean[layer_id], pool.v_mean[layer_id]
    reference.store_kv(k_pool, v_pool, k, v, batch.out_slots, k_scale, v_scale, k_mean, v_mean)
    if batch.prefix_lens_cpu[0] == 0:  # this pass computes position 0 (a window's first chunk)
        _exact[layer_id] = (k[0].float().clone(), v[0].float().clone())
    pages = batch.page_table[0].long()
    k_f = k_pool[pages].float() * k_scale[None, None, :, None]  # [Pmax, S, K, D], centred
    v_f = v_pool[pages].float() * v_scale[None, None, :, None]
    if os.environ.get("KV_SINK_EXACT", "1") != "0":
        k0, v0 = _exact[layer_id]
        k_f[0, 0] = k0 - (k_mean if k_mean is not None else 0.0)
        v_f[0, 0] = v0 - (v_mean if v_mean is not None else 0.0)
    table = torch.arange(len(pages), dtype=torch.int32, device=pages.device)[None]
    scale = q.shape[-1] ** -0.5
    if batch.is_decode:
        out = reference.paged_decode_attention(q, k_f, v_f, table, [batch.prefix_lens_cpu[0] + 1], scale)
    else:
        out = reference.paged_attention(q, k_f, v_f, table, batch.prefix_lens_cpu, batch.extend_lens_cpu,
                                        scale=scale)  # fmt: skip
    return pool.add_v_mean(out, layer_id)


if __name__ == "__main__":
    attention.TorchAttentionBackend.forward = _forward
    sys.argv = [str(Path(__file__).with_name("kv_quality.py")), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
