"""TritonAttentionBackend against TorchAttentionBackend through ForwardBatch and KVPool:
a mixed extend pass (prefill, cached-prefix chunk, decode rows), then a pure decode step
that takes the split-KV path, then the registry and "auto" selection.

Dimension letters: T new tokens, H query heads, K kv heads, D head dim, S page size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixlm.kernels import reference  # noqa: E402
from radixlm.runtime.executor import attention  # noqa: E402
from radixlm.runtime.executor.attention import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
    attention_backend_choices,
    create_attention_backend,
)
from radixlm.runtime.executor.forward_batch import ForwardBatch  # noqa: E402
from radixlm.runtime.memory.kv_pool import KVPool  # noqa: E402

from .conftest import DEVICE  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 6, 2, 64, 4


def _pool(kv_cache_dtype: str = "auto") -> KVPool:
    """``<dtype>+means``: the FP8 slots store values centred on channel means (the
    calibration's), which the backends add back to the output for V."""
    kv_cache_dtype, _, centred = kv_cache_dtype.partition("+")
    scales = (torch.tensor([[0.011, 0.007]]), torch.tensor([[0.009, 0.013]]))  # [L, K]
    if centred:
        gen = torch.Generator().manual_seed(11)
        scales += tuple(torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    pool = KVPool(24, PAGE, 1, KV_HEADS, HEAD_DIM, torch.float32, DEVICE, kv_cache_dtype,
                  *(scales if kv_cache_dtype in ("fp8_e4m3", "int4", "mixed") else (None, None)),
                  window_pages=1)  # fmt: skip
    pool.k[0].fill_(float("nan"))  # slots never written must never be read
    # ... except a channel-major FP8 V pool's (fp8_e4m3): the kernels read whole V pages and
    # weight the slots past a request's last key by 0, so the pool keeps them finite (zeros;
    # here the largest e4m3 value, which a nonzero weight would show).
    pool.v[0].fill_(reference.FP8_E4M3_MAX if reference.channel_major(pool.v[0]) else float("nan"))
    return pool


def _step(backend, pool: KVPool, batch: ForwardBatch, seed: int, heads: int = HEADS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens, kv_heads, head_dim = batch.num_tokens, pool.num_kv_heads, pool.head_dim
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE)
    kv = torch.randn(tokens, 2 * kv_heads, head_dim, generator=gen).to(DEVICE)
    tables = batch.page_table.tolist()
    writes = list(zip(tables, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True))
    pool.begin_pass(writes)  # int4 / mixed: FP8 slots for the pages written, then demotion
    backend.prepare(batch, pool)
    out = backend.forward(q, kv[:, :kv_heads], kv[:, kv_heads:], 0, batch, pool)
    pool.end_pass(writes)
    return out


@pytest.mark.parametrize(
    "kv_cache_dtype", ["auto", "fp8_e4m3", "int4", "mixed", "fp8_e4m3+means", "mixed+means"]
)
def test_triton_backend_matches_torch_backend(kv_cache_dtype: str) -> None:
    pools = {"torch": _pool(kv_cache_dtype), "triton": _pool(kv_cache_dtype)}
    backends = {"torch": TorchAttentionBackend(DEVICE), "triton": TritonAttentionBackend(DEVICE)}
    if kv_cache_dtype != "auto" and DEVICE == "cpu":
        # The Triton interpreter's float32 -> e4m3 conversion loses the carry into the next
        # binade for a few values (tests/kernels/test_kv_fp8.py checks store_kv with that
        # allowance), so here the triton backend stores through the reference.
        backends["triton"]._store_kv = reference.store_kv
    tables = [[5, 2, 9], [7, 1, 3, 11, 4, 8, 12], [6, 10]]  # shuffled pages
    prefill = ForwardBatch.build(
        tokens=[[1] * 9, [2] * 21, [3] * 6],
        prefix_lens=[0, 0, 0],
        page_tables=tables,
        logits_rows=[8, 29, 35],
        page_size=PAGE,
        device=DEVICE,
    )
    # Second pass: request 1 extends 3 tokens from mid-page, the others decode one token.
    mixed = ForwardBatch.build([[4], [5] * 3, [6]], [9, 21, 6], tables, [0, 3, 4], PAGE, DEVICE)
    decode = ForwardBatch.build([[7], [8], [9]], [10, 24, 7], tables, [0, 1, 2], PAGE, DEVICE)
    assert decode.is_decode and not mixed.is_decode
    for seed, batch in enumerate([prefill, mixed, decode]):
        outs = {name: _step(backends[name], pools[name], batch, seed) for name in backends}
        assert not outs["triton"].isnan().any()
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools["triton"].k[0].float(), pools["torch"].k[0].float(), equal_nan=True)
    if pools["torch"].tiered:  # INT4 pages were read: the requests filled 2, 6 and 2 pages
        demoted = {"int4": 10, "mixed": 4}[kv_cache_dtype.partition("+")[0]]  # mixed: sink + 1 window page kept
        assert pools["torch"].num_demoted == pools["triton"].num_demoted == demoted
        int4 = [p for row in tables for p in row if int(pools["torch"].fp8_slot[p]) < 0]
        assert len(int4) == demoted
        assert torch.equal(pools["triton"].k_codes[0][int4], pools["torch"].k_codes[0][int4])


@pytest.mark.parametrize("kv_cache_dtype", ["mixed", "int4", "fp8_e4m3"])
def test_triton_backend_reads_a_prefix_another_request_left_in_mixed_pages(kv_cache_dtype: str) -> None:
    """SmolLM2's attention shape (9 heads on 3 kv heads, D 64) with 16-token pages: request A
    prefills 57 tokens and decodes 11 (mixed, window 2: its page 1 is demoted to INT4, pages
    0, 2 and 3 stay FP8), then request B extends 9 tokens over A's first 48 from the radix
    cache (FP8 sink, INT4, FP8 pages, then its own fresh page). Both backends agree on
    every pass (a GPU server once gave B another first token on each backend: a near-tie)."""
    g = torch.Generator().manual_seed(3)
    scales = (torch.rand(1, 3, generator=g) * 0.02 + 0.005, torch.rand(1, 3, generator=g) * 0.02 + 0.005)
    pools = {name: KVPool(24, 16, 1, 3, 64, torch.float32, DEVICE, kv_cache_dtype, *scales, window_pages=2)
             for name in ("torch", "triton")}  # fmt: skip
    backends = {"torch": TorchAttentionBackend(DEVICE), "triton": TritonAttentionBackend(DEVICE)}
    if DEVICE == "cpu":  # the interpreter's e4m3 conversion (see above)
        backends["triton"]._store_kv = reference.store_kv
    table_a, table_b = [5, 2, 9, 7, 11], [5, 2, 9, 13]
    passes = [ForwardBatch.build([[1] * 57], [0], [table_a], [56], 16, DEVICE)]
    passes += [ForwardBatch.build([[2]], [57 + t], [table_a], [0], 16, DEVICE) for t in range(11)]
    passes.append(ForwardBatch.build([[3] * 9], [48], [table_b], [8], 16, DEVICE))
    for seed, batch in enumerate(passes):
        outs = {name: _step(backends[name], pools[name], batch, seed, heads=9) for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    if kv_cache_dtype != "fp8_e4m3":
        int4 = [p for p in table_b[:3] if int(pools["triton"].fp8_slot[p]) < 0]
        assert int4 == {"mixed": [2], "int4": [5, 2, 9]}[kv_cache_dtype]


def test_triton_backend_split_extend_over_a_long_prefix() -> None:
    """A short extend over a long cached prefix takes the split-KV extend path (N > 1,
    chosen in prepare/first layer from host lengths) and matches the torch backend; a
    decode pass afterwards re-picks the decode split count."""
    pools = {name: KVPool(100, PAGE, 1, KV_HEADS, HEAD_DIM, torch.float32, DEVICE) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(DEVICE), "triton": TritonAttentionBackend(DEVICE)}
    table = list(torch.randperm(99, generator=torch.Generator().manual_seed(0)) + 1)[:80]
    table = [int(p) for p in table]
    prefill = ForwardBatch.build([[1] * 301], [0], [table], [300], PAGE, DEVICE)
    extend = ForwardBatch.build([[2] * 6, [3]], [301, 0], [table, [99]], [5, 6], PAGE, DEVICE)
    for seed, batch in enumerate([prefill, extend]):
        outs = {name: _step(backends[name], pools[name], batch, seed) for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    # 4 SMs under the interpreter; on a GPU the SM count gives another N: only check > 1.
    assert backends["triton"]._num_splits > 1
    assert backends["triton"]._workspace.partial_lse.shape[:2] == (7, HEADS)


def test_triton_backend_mixed_pass_runs_leading_decodes_through_the_decode_kernel(monkeypatch) -> None:
    """A mixed pass whose first requests decode (the planner's running requests) and whose
    last ones extend: the decode rows take the decode kernel (split over their long
    prefixes), the rest the extend kernel (a short extend over a long prefix: split too);
    the output matches the torch backend (``MIXED_SPLIT_MIN_DECODES`` lowered to 3). A pass
    that starts with an extend keeps one launch, and so do fewer leading decodes than the
    threshold."""
    pools = {name: KVPool(200, PAGE, 1, KV_HEADS, HEAD_DIM, torch.float32, DEVICE) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(DEVICE), "triton": TritonAttentionBackend(DEVICE)}
    perm = [int(p) + 1 for p in torch.randperm(199, generator=torch.Generator().manual_seed(1))]
    tables = [perm[0:50], perm[50:100], perm[100:150], perm[150:199]]
    prefill = ForwardBatch.build([[1] * 190, [2] * 150, [3] * 170, [4] * 180], [0] * 4, tables,
                                 [189, 339, 509, 689], PAGE, DEVICE)  # fmt: skip
    # three decodes, then an extend of 5 over a 180-token prefix
    mixed = ForwardBatch.build([[5], [6], [7], [8] * 5], [190, 150, 170, 180], tables, [0, 1, 2, 7], PAGE, DEVICE)
    ext_first = ForwardBatch.build([[9] * 2, [5]], [185, 191], [tables[3], tables[0]], [1, 2], PAGE, DEVICE)
    monkeypatch.setattr(attention, "MIXED_SPLIT_MIN_DECODES", 3)
    for seed, batch in enumerate([prefill, mixed]):
        outs = {name: _step(backends[name], pools[name], batch, seed) for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    split = backends["triton"]._mixed
    assert split is not None and split.decode_rows == 3 and split.cu_extend.tolist() == [0, 5]
    assert split.dec_splits > 1 and split.ext_splits > 1  # both kernels split their long prefixes
    outs = {name: _step(backends[name], pools[name], ext_first, 7) for name in backends}
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    assert backends["triton"]._mixed is None
    monkeypatch.setattr(attention, "MIXED_SPLIT_MIN_DECODES", 4)  # 3 leading decodes: one launch
    backends["triton"].prepare(mixed, pools["triton"])
    assert backends["triton"]._mixed is None


def test_triton_backend_cascade_decode_over_shared_prefix_pages(monkeypatch) -> None:
    """Requests 1 and 2 extend over request 0's first 8 pages (as radix-cache hits do):
    the decode pass, and the decode rows of a mixed pass, take cascade decode (a plan with
    the three of them in one chunk sharing 32 keys) and match the torch backend; with
    ``enable_cascade`` off (``--disable-cascade-attention``), the plan saving fewer than
    ``CASCADE_MIN_SAVED_KEYS`` key reads or sharing fewer than ``CASCADE_MIN_SHARED_KEYS``
    keys, no plan."""
    pools = {name: KVPool(40, PAGE, 1, KV_HEADS, HEAD_DIM, torch.float32, DEVICE) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(DEVICE), "triton": TritonAttentionBackend(DEVICE)}
    shared = [5, 2, 9, 7, 11, 3, 14, 20]
    tables = [shared + [21, 22, 23], shared + [24, 25], shared + [26, 27, 28, 29], [30, 31, 32, 33]]
    passes = [
        ForwardBatch.build([[1] * 41], [0], tables[:1], [40], PAGE, DEVICE),
        ForwardBatch.build([[2] * 5, [3] * 14, [4] * 10], [32, 32, 0], tables[1:], [4, 18, 28], PAGE, DEVICE),
        ForwardBatch.build([[5], [6], [7], [8]], [41, 37, 46, 10], tables, [0, 1, 2, 3], PAGE, DEVICE),
        ForwardBatch.build([[9], [10], [11], [12] * 3], [42, 38, 47, 11], tables, [0, 1, 2, 5], PAGE, DEVICE),
    ]
    monkeypatch.setattr(attention, "CASCADE_MIN_SAVED_KEYS", 64)  # 2 x 32 keys saved
    monkeypatch.setattr(attention, "CASCADE_MIN_SHARED_KEYS", 32)
    monkeypatch.setattr(attention, "MIXED_SPLIT_MIN_DECODES", 3)
    plans = []
    for seed, batch in enumerate(passes):
        outs = {name: _step(backends[name], pools[name], batch, seed) for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
        plans.append(backends["triton"]._shared)
    assert plans[0] is plans[1] is None  # no decode rows
    for plan in plans[2:]:
        assert sorted(plan.chunk_rows[0].tolist())[-3:] == [0, 1, 2] and plan.chunk_keys.tolist() == [32]
        assert plan.skip_lens.tolist()[:3] == [32, 32, 32] and plan.saved_keys == 64
    assert plans[3].skip_lens.shape == (3,)  # the mixed pass: its three decode rows
    assert backends["triton"].cascade_worth([tables[0], tables[1], tables[2]], pools["triton"])
    monkeypatch.setattr(attention, "CASCADE_MIN_SAVED_KEYS", 65)
    backends["triton"].prepare(passes[2], pools["triton"])
    _step(backends["triton"], pools["triton"], passes[2], 9)
    assert backends["triton"]._shared is False
    monkeypatch.setattr(attention, "CASCADE_MIN_SAVED_KEYS", 64)
    monkeypatch.setattr(attention, "CASCADE_MIN_SHARED_KEYS", 33)  # 9 pages: more than the 8 shared
    _step(backends["triton"], pools["triton"], passes[2], 9)
    assert backends["triton"]._shared is False
    monkeypatch.setattr(attention, "CASCADE_MIN_SHARED_KEYS", 32)
    backends["triton"].enable_cascade = False
    _step(backends["triton"], pools["triton"], passes[2], 9)
    assert backends["triton"]._shared is False
    assert not backends["triton"].cascade_worth([tables[0], tables[1], tables[2]], pools["triton"])


def test_registry_lists_triton_and_auto_picks_torch_on_cpu() -> None:
    assert attention_backend_choices() == ("auto", "torch", "triton")
    assert isinstance(create_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(create_attention_backend("triton", DEVICE), TritonAttentionBackend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda() -> None:
    assert isinstance(create_attention_backend("auto", "cuda"), TritonAttentionBackend)


@pytest.mark.parametrize("gemv", ["as_on_the_device", "forced"])
def test_model_on_the_triton_backend_uses_fused_kernels_and_matches_torch(tiny_hf_model, monkeypatch, gemv) -> None:
    """The whole model with the Triton backend (fused add+RMSNorm, RoPE, SiLU-mul kernels,
    residual kept apart) gives the torch backend's logits: a prefill then a decode step.
    ``forced``: the batch-1 GEMVs with RMSNorm / SiLU (and the QKV one's RoPE + KV
    store) fused in, CUDA-only in the model, run here too, and must have run."""
    import random

    from radixlm.kernels import gemv as gemv_module
    from radixlm.runtime.executor.model_loader import load_model
    from radixlm.runtime.executor.models import decoder

    calls: list[str] = []
    if gemv == "forced":
        monkeypatch.setattr(decoder, "_gemv_ok", lambda layer, x: x.shape[0] == 1 and layer.bias is None)
        for name in ("rmsnorm_gemv", "silu_mul_gemv"):
            fn = getattr(gemv_module, name)
            def record(*a, _fn=fn, _name=name, **kw):
                calls.append(_name + ("+rope_store" if kw.get("rope_store") is not None else ""))
                return _fn(*a, **kw)

            monkeypatch.setattr(gemv_module, name, record)

    model_dir = tiny_hf_model(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})[0]
    models = {name: load_model(model_dir, torch.float32, DEVICE, name) for name in ("torch", "triton")}
    assert models["triton"].model.fused and not models["torch"].model.fused
    ids = random.Random(0).choices(range(256), k=13)
    table = [3, 7, 1, 9]
    logits = {}
    for name, model in models.items():
        pool = KVPool(12, PAGE, model.config.num_hidden_layers, 2, 16, torch.float32, DEVICE)
        with torch.inference_mode():
            prefill = ForwardBatch.build([ids[:12]], [0], [table], list(range(12)), PAGE, DEVICE)
            first = model.compute_logits(model(prefill, pool))
            step = ForwardBatch.build([ids[12:]], [12], [table], [0], PAGE, DEVICE)
            logits[name] = torch.cat([first, model.compute_logits(model(step, pool))])
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-5, rtol=2e-5)
    if gemv == "forced":  # the decode step (one row): 2 norms (one with RoPE + KV store) + 1 SiLU per layer
        layers = models["triton"].config.num_hidden_layers
        assert sorted(calls) == (["rmsnorm_gemv"] * layers + ["rmsnorm_gemv+rope_store"] * layers
                                 + ["silu_mul_gemv"] * layers)  # fmt: skip


def test_model_decode_step_over_shared_prefix_pages_takes_cascade_decode(tiny_hf_model, monkeypatch) -> None:
    """The whole model on the Triton backend: request B extends over request A's first 4
    pages (a radix-cache hit), then a decode step of A, B and an unrelated C takes cascade
    decode (thresholds lowered) and gives the torch backend's logits."""
    import random

    from radixlm.runtime.executor.model_loader import load_model

    monkeypatch.setattr(attention, "CASCADE_MIN_SAVED_KEYS", 16)
    monkeypatch.setattr(attention, "CASCADE_MIN_SHARED_KEYS", 16)
    model_dir = tiny_hf_model()[0]
    models = {name: load_model(model_dir, torch.float32, DEVICE, name) for name in ("torch", "triton")}
    rng = random.Random(1)
    a, b_new, c = rng.choices(range(256), k=21), rng.choices(range(256), k=7), rng.choices(range(256), k=9)
    tables = [[3, 7, 1, 9, 2, 11], [3, 7, 1, 9, 5, 6], [8, 10, 12]]
    logits = {}
    for name, model in models.items():
        pool = KVPool(14, PAGE, model.config.num_hidden_layers, 2, 16, torch.float32, DEVICE)
        with torch.inference_mode():
            passes = [
                ForwardBatch.build([a[:20], c[:8]], [0, 0], [tables[0], tables[2]], [19, 27], PAGE, DEVICE),
                ForwardBatch.build([b_new[:6]], [16], [tables[1]], [5], PAGE, DEVICE),  # A's 16 keys cached
                ForwardBatch.build([a[20:], b_new[6:], c[8:]], [20, 22, 8], tables, [0, 1, 2], PAGE, DEVICE),
            ]
            logits[name] = torch.cat([model.compute_logits(model(batch, pool)) for batch in passes])
    plan = models["triton"].attn_backend._shared
    assert plan and plan.chunk_keys.tolist() == [16] and plan.skip_lens.tolist() == [16, 16, 0]
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-5, rtol=2e-5)


def test_fused_rope_applies_the_pool_key_rotation(tiny_hf_model) -> None:
    """Head dim 64: the Triton model path (the rotation inside the fused RoPE launch) stores
    the same rotated keys as the PyTorch path (RoPE, then ``KVPool.rotate_qk``), keys @ R of
    an unrotated pool, and both give the unrotated pool's logits (scores are unchanged).
    Float pools: the FP8 Triton kernels do not run under the CPU interpreter."""
    import random

    from radixlm.runtime.executor.model_loader import load_model
    from radixlm.runtime.memory.kv_pool import key_rotation

    model_dir = tiny_hf_model(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})[0]  # fmt: skip
    models = {name: load_model(model_dir, torch.float32, DEVICE, name) for name in ("torch", "triton")}
    ids = random.Random(1).choices(range(256), k=13)
    table = [3, 7, 1, 9]
    keys, logits = {}, {}
    for name, model in models.items():
        for rotation in (None, "hadamard"):
            pool = KVPool(12, PAGE, model.config.num_hidden_layers, 1, 64, torch.float32, DEVICE, k_rotation=rotation)
            with torch.inference_mode():
                prefill = ForwardBatch.build([ids[:12]], [0], [table], [11], PAGE, DEVICE)
                first = model.compute_logits(model(prefill, pool))
                step = ForwardBatch.build([ids[12:]], [12], [table], [0], PAGE, DEVICE)
                logits[name, rotation] = torch.cat([first, model.compute_logits(model(step, pool))])
            keys[name, rotation] = torch.stack([pool.k[layer][table].reshape(-1, 64)[:13] for layer in range(2)])
    r = key_rotation(64).to(DEVICE)
    for name in models:
        torch.testing.assert_close(keys[name, "hadamard"], keys[name, None] @ r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[name, "hadamard"], logits["torch", None], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(keys["triton", "hadamard"], keys["torch", "hadamard"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mixed_split", "mixed", "prefill_split", "decode"])
def test_static_layers_replays_layer_zeros_launches_over_each_layers_pools(monkeypatch, kind: str) -> None:
    """``static_layers`` (the piecewise graphs' attention): layer 0 launches through Triton
    and is recorded, layers 1-2 replay those launches with their own pools swapped in. The
    queries change in place between layers (as the graph pieces rewrite the static
    buffer); every layer's output equals the torch backend's over that layer's pages. A
    pass with leading decodes splits them off from one decode row (``MIXED_SPLIT_MIN_DECODES``
    is for passes launched from Python)."""
    from radixlm.kernels import launch as launch_module

    layers = 3
    pool = KVPool(200, PAGE, layers, KV_HEADS, HEAD_DIM, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(4)
    for layer in range(layers):  # different keys and values per layer
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=gen))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=gen))
    perm = [int(p) + 1 for p in torch.randperm(199, generator=torch.Generator().manual_seed(1))]
    tables = [perm[0:50], perm[50:100], perm[100:150], perm[150:199]]
    batch = {  # three decodes then an extend of 5 over a 180-token prefix
        "mixed_split": ForwardBatch.build([[5], [6], [7], [8] * 5], [190, 150, 170, 180], tables, [0, 1, 2, 7],
                                          PAGE, DEVICE),
        "mixed": ForwardBatch.build([[8] * 5, [5], [6]], [180, 190, 150], tables[:3], [4, 5, 6], PAGE, DEVICE),
        "prefill_split": ForwardBatch.build([[2] * 6, [3] * 9], [170, 0], tables[:2], [5, 14], PAGE, DEVICE),
        "decode": ForwardBatch.build([[5], [6], [7]], [190, 150, 170], tables[:3], [0, 1, 2], PAGE, DEVICE),
    }[kind]  # fmt: skip
    recorded: list[str] = []
    replays: list[str] = []
    cls = launch_module.RecordedLaunch
    init, replay = cls.__init__, cls.replay
    monkeypatch.setattr(cls, "__init__", lambda self, fn, *a: (recorded.append(fn.__name__), init(self, fn, *a))[1])
    monkeypatch.setattr(cls, "replay", lambda self, *a: (replays.append(self.fn.__name__), replay(self, *a))[1])
    triton_backend, torch_backend = TritonAttentionBackend(DEVICE), TorchAttentionBackend(DEVICE)
    tokens = batch.num_tokens
    q = torch.empty(tokens, HEADS, HEAD_DIM, device=DEVICE)
    kv = torch.zeros(tokens, 2 * KV_HEADS, HEAD_DIM, device=DEVICE)  # unused: K / V already stored
    out = torch.full((tokens, HEADS, HEAD_DIM), float("nan"), device=DEVICE)
    triton_backend.prepare(batch, pool)
    torch_backend.prepare(batch, pool)
    assert triton_backend._mixed is None  # 3 leading decodes: below the threshold of Python launches
    attend = triton_backend.static_layers(q, kv[:, :KV_HEADS], kv[:, KV_HEADS:], out, batch, pool)
    for layer in range(layers):
        q.copy_(torch.randn(q.shape, generator=gen))
        attend(layer)
        want = torch_backend.forward(q, kv[:, :KV_HEADS], kv[:, KV_HEADS:], layer, batch, pool, kv_stored=True)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert (triton_backend._mixed is not None) == (kind == "mixed_split")
    if kind == "mixed_split":  # both kernels split their long prefixes: split + merge each
        assert recorded == ["_decode_split_kernel", "_decode_merge_kernel", "_extend_split_kernel",
                            "_decode_merge_kernel"]  # fmt: skip
    assert recorded and replays == recorded * (layers - 1)
