"""Quantised KV cache in the runtime: the FP8 KVPool layout and capacity, swap of FP8
pages, calibration and the scales file, the flags, and the refusal to start without
usable scales.

Dimension letters: L layers, K kv heads, D head dim, P pages, S page size.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixlm.kernels import reference
from radixlm.runtime.executor.attention import TorchAttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.kv_calibration import (
    KVScales,
    KVScalesError,
    calibrate_kv_scales,
    load_kv_scales,
    save_kv_scales,
)
from radixlm.runtime.executor.kv_calibration import main as kv_main
from radixlm.runtime.executor.model_loader import load_model
from radixlm.runtime.memory.kv_pool import KVPool, key_rotation, kv_bytes_per_token
from radixlm.runtime.server_args import ServerArgs

from ..executor.test_model import Session, full_logits

FP8 = torch.float8_e4m3fn


def _scales(
    layers: int = 2, heads: int = 2, value: float = 0.01
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((layers, heads), value), torch.full((layers, heads), 2 * value)


def test_fp8_pool_holds_twice_the_bf16_tokens_in_the_same_bytes() -> None:
    bf16 = KVPool(9, 16, 30, 3, 64, torch.float32, "cpu", "bf16")
    fp8 = KVPool(9, 16, 30, 3, 64, torch.float32, "cpu", "fp8_e4m3", *_scales(30, 3))
    assert bf16.dtype == torch.bfloat16 and fp8.dtype == FP8 and fp8.k[0].dtype == FP8
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 2 * fp8.bytes_per_token
    assert fp8.metadata_bytes == 2 * 30 * 3 * 4 and bf16.metadata_bytes == 0
    assert fp8.total_bytes == 9 * 16 * fp8.bytes_per_token + fp8.metadata_bytes
    budget = (
        23040 * 4321
    )  # the sizing rule of ModelRunner._size_pool: tokens = budget // bytes per token
    assert budget // kv_bytes_per_token(30, 3, 64, FP8) == 2 * (
        budget // kv_bytes_per_token(30, 3, 64, torch.bfloat16)
    )
    assert KVPool(9, 16, 1, 1, 16, torch.float32, "cpu").dtype == torch.float32  # auto: model dtype


@pytest.mark.parametrize(("k_scales", "message"), [
    (None, "needs k_scales"),
    (torch.full((2, 3), 0.1), r"shape \(2, 3\) != \(layers, kv heads\) = \(2, 2\)"),
    (torch.tensor([[0.1, 0.0], [0.1, 0.1]]), "finite and > 0"),
    (torch.tensor([[0.1, float("nan")], [0.1, 0.1]]), "finite and > 0"),
])  # fmt: skip
def test_fp8_pool_refuses_unusable_scales(k_scales, message) -> None:
    with pytest.raises(ValueError, match=message):
        KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", k_scales, _scales()[1])


def test_unknown_kv_cache_dtype() -> None:
    with pytest.raises(ValueError, match="unknown kv cache dtype 'int3'"):
        KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "int3")


def test_fp8_pages_swap_through_host_memory_bit_for_bit() -> None:
    pool = KVPool(6, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales())
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(6, 4, 2, 16).to(FP8))
        pool.v[layer].copy_(torch.randn(6, 4, 2, 16).to(FP8))
    host = pool.read_pages([2, 5])
    assert host.dtype == FP8 and host.shape == (2, 2, 2, 4, 2, 16)
    pool.write_pages([1, 3], host)
    for layer in range(2):
        assert torch.equal(
            pool.k[layer][[1, 3]].view(torch.uint8), pool.k[layer][[2, 5]].view(torch.uint8)
        )
        assert torch.equal(
            pool.v[layer][[1, 3]].view(torch.uint8), pool.v[layer][[2, 5]].view(torch.uint8)
        )


def test_fp8_pool_stores_v_channel_major_and_zeroed() -> None:
    """fp8_e4m3 pools keep V channel-major ([P, K, D, S] in memory, zero-filled: the
    kernels read whole V pages); other page sizes, tiered and float pools keep V row-major."""
    pool = KVPool(6, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales())
    for layer in range(2):
        assert reference.channel_major(pool.v[layer]) and pool.v[layer].stride() == (2 * 16 * 4, 1, 16 * 4, 4)
        assert bool((pool.v[layer].float() == 0).all())
        assert pool.k[layer].is_contiguous()
    others = [KVPool(6, 3, 1, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales(1)),
              KVPool(6, 4, 1, 2, 16, torch.float32, "cpu", "mixed", *_scales(1)),
              KVPool(6, 4, 1, 2, 16, torch.float32, "cpu")]  # fmt: skip
    for other in others:
        assert other.v[0].is_contiguous() and not reference.channel_major(other.v[0])


def test_calibration_means_and_scales_of_the_centred_values(tiny_hf_model: Callable) -> None:
    """means = per-channel token means of the stored K/V; scales = 2 x absmax(x - mean) /
    448; with center=False no means and the absmax of the raw values."""
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    ids = random.Random(5).choices(range(256), k=37)
    scales = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32, rotate=False)
    assert isinstance(scales, KVScales) and scales.k_scale.shape == scales.v_scale.shape == (2, 2)
    assert scales.k_mean.shape == scales.v_mean.shape == (2, 2, 16) and scales.k_rotation is None
    raw = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32, center=False, rotate=False)
    assert raw.k_mean is None and raw.v_mean is None
    # The default rotates the keys (D = 16 is a power of two): K statistics of k @ R, V's unchanged.
    rotated = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32)
    assert rotated.k_rotation == "hadamard"
    torch.testing.assert_close(rotated.v_mean, scales.v_mean) and torch.testing.assert_close(rotated.v_scale, scales.v_scale)
    assert not torch.allclose(rotated.k_scale, scales.k_scale)
    # The same K/V, stored by a plain forward pass into a float pool.
    session = Session(model, page_size=4)
    session.step({0: (ids, 0)})
    pages = session.tables[0]
    for layer in range(2):
        k = session.pool.k[layer][pages].reshape(-1, 2, 16)[:37]
        v = session.pool.v[layer][pages].reshape(-1, 2, 16)[:37]
        for x, mean, scale, raw_scale in ((k, scales.k_mean, scales.k_scale, raw.k_scale),
                                          (v, scales.v_mean, scales.v_scale, raw.v_scale)):  # fmt: skip
            torch.testing.assert_close(mean[layer], x.mean(dim=0))
            torch.testing.assert_close(scale[layer], (x - x.mean(dim=0)).abs().amax(dim=(0, 2)) * 2 / 448)
            torch.testing.assert_close(raw_scale[layer], x.abs().amax(dim=(0, 2)) * 2 / 448)
        k = k @ key_rotation(16)
        torch.testing.assert_close(rotated.k_mean[layer], k.mean(dim=0))
        torch.testing.assert_close(rotated.k_scale[layer], (k - k.mean(dim=0)).abs().amax(dim=(0, 2)) * 2 / 448)
    with pytest.raises(KVScalesError, match="at least one token"):
        calibrate_kv_scales(model, [], 4, "cpu", torch.float32)


def test_fp8_cache_logits_stay_close_to_the_float_cache(tiny_hf_model: Callable) -> None:
    """Chunked prefill + decode on FP8 pages (torch backend): logits within a few percent
    of the float cache's, but not identical (the cache really is quantised)."""
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    ids = random.Random(6).choices(range(256), k=30)
    scales = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32)
    assert scales.k_rotation == "hadamard"  # the model rotates q and k for this pool
    session = Session(model, page_size=4)
    session.pool = KVPool(64, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *scales)
    got = [session.step({0: (ids[:20], 0)})[0]] + [
        session.step({0: ([ids[t]], t)})[0] for t in range(20, 30)
    ]
    got_t, ref = torch.cat(got), full_logits(model, ids)
    err = float((got_t - ref).norm() / ref.norm())
    assert 1e-4 < err < 0.05, err


def _fp8_attention_error(centred: bool, rotated: bool = False, outliers: float = 1.0) -> float:
    """Relative error of FP8 attention (torch backend: prefill then decode) against a
    float pool, on keys with a large per-channel offset (as some key channels carry) and
    values with one, with or without the channel means and the key rotation (applied as
    the model applies it, ``KVPool.rotate_qk``). ``outliers`` scales key channels 2 and 7
    and the queries' same channels (post-RoPE low-frequency channels are large in both)."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 4, 2, 16, 24
    offset_k = torch.zeros(kv_heads, dim)
    offset_k[:, 2], offset_k[:, 7] = 30.0, -20.0
    offset_v = torch.randn(kv_heads, dim, generator=gen) * 4
    k = torch.randn(tokens, kv_heads, dim, generator=gen) + offset_k
    v = torch.randn(tokens, kv_heads, dim, generator=gen) + offset_v
    q = torch.randn(tokens, heads, dim, generator=gen) * 0.3
    k[..., [2, 7]] *= outliers
    q[..., [2, 7]] *= outliers
    stored_k = k @ key_rotation(dim) if rotated else k
    k_mean, v_mean = (stored_k.mean(0), v.mean(0)) if centred else (torch.zeros(kv_heads, dim),) * 2
    scales = ((stored_k - k_mean).abs().amax(dim=(0, 2))[None] * 2 / 448,
              (v - v_mean).abs().amax(dim=(0, 2))[None] * 2 / 448)  # fmt: skip
    means = (k_mean[None], v_mean[None]) if centred else (None, None)
    rotation = "hadamard" if rotated else None
    outs = []
    for pool in (KVPool(8, 4, 1, kv_heads, dim, torch.float32, "cpu"),
                 KVPool(8, 4, 1, kv_heads, dim, torch.float32, "cpu", "fp8_e4m3", *scales, *means, rotation)):  # fmt: skip
        backend = TorchAttentionBackend("cpu")
        table = [[3, 1, 6, 2, 5, 4]]
        qp, kp = pool.rotate_qk(q, k)
        prefill = ForwardBatch.build([[1] * 20], [0], table, [19], 4, "cpu")
        out = [backend.forward(qp[:20], kp[:20], v[:20], 0, prefill, pool)]
        for t in range(20, tokens):
            decode = ForwardBatch.build([[1]], [t], table, [0], 4, "cpu")
            out.append(backend.forward(qp[t:t + 1], kp[t:t + 1], v[t:t + 1], 0, decode, pool))
        outs.append(torch.cat(out))
    return float((outs[1] - outs[0]).norm() / outs[0].norm())


def test_channel_means_cut_the_fp8_attention_error() -> None:
    """Centring is exact for attention (softmax shift for K, weights summing to one for V),
    so only the rounding of the smaller centred values is left."""
    centred, plain = _fp8_attention_error(True), _fp8_attention_error(False)
    assert centred < 0.01 and centred < plain / 4, (centred, plain)


def test_key_rotation_keeps_scores_and_is_checked() -> None:
    """R R^T = D I exactly; q R / D . k R = q . k; pools take it for a power-of-two head
    dim only; its two matrices are counted in the metadata."""
    r = key_rotation(16)
    assert set(r.unique().tolist()) == {-1.0, 1.0} and torch.equal(r @ r.T, 16 * torch.eye(16))
    assert torch.equal(key_rotation(16), r) and key_rotation(96) is None and key_rotation(1) is not None
    pool = KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales(), None, None, "hadamard")
    plain = KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales())
    assert pool.metadata_bytes == plain.metadata_bytes + 2 * 16 * 16 * 4
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    qr, kr = pool.rotate_qk(q, k)
    assert qr.shape == q.shape and kr.shape == k.shape and not torch.allclose(kr, k)
    torch.testing.assert_close(torch.einsum("thd,shd->hts", qr[:, ::2], kr), torch.einsum("thd,shd->hts", q[:, ::2], k))
    assert plain.rotate_qk(q, k) == (q, k)
    with pytest.raises(ValueError, match="pools take one of"):
        KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales(), None, None, "givens")
    with pytest.raises(ValueError, match="head dim 12"):
        KVPool(4, 4, 2, 2, 12, torch.float32, "cpu", "fp8_e4m3", *_scales(), None, None, "hadamard")


def test_key_rotation_cuts_the_fp8_attention_error_of_outlier_channels() -> None:
    """Keys and queries with two channels far larger than the rest: rotated, each stored
    channel mixes all 16, and the score error (relative to each element) shrinks."""
    rotated, plain = (_fp8_attention_error(True, rotated, outliers=8.0) for rotated in (True, False))
    assert rotated < plain * 0.7, (rotated, plain)


def test_pool_channel_means_are_checked_and_counted() -> None:
    k_means = torch.zeros(2, 2, 16)
    pool = KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales(), k_means, k_means + 1)
    assert pool.metadata_bytes == 2 * 2 * 2 * 4 + 2 * 2 * 2 * 16 * 4
    assert float(pool.add_v_mean(torch.zeros(3, 4, 16), 1).min()) == 1.0  # [T, H, D] += v_mean
    for args, message in (
        ((k_means, None), "need both k_means and v_means; v_means is missing"),
        ((k_means, torch.zeros(2, 2, 8)), r"v_means shape \(2, 2, 8\) != \(layers, kv heads, head dim\)"),
        ((k_means, torch.full((2, 2, 16), float("nan"))), "v_means must be finite"),
    ):
        with pytest.raises(ValueError, match=message):
            KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *_scales(), *args)
    with pytest.raises(ValueError, match="go with an fp8_e4m3 / int4 / mixed pool"):
        KVPool(4, 4, 2, 2, 16, torch.float32, "cpu", "bf16", None, None, k_means, k_means)


def test_scales_file_round_trip_and_errors(tmp_path: Path) -> None:
    k, v = torch.rand(3, 2) + 0.1, torch.rand(3, 2) + 0.1
    k_mean, v_mean = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    path = tmp_path / "scales.json"
    save_kv_scales(path, KVScales(k, v, k_mean, v_mean))
    got = load_kv_scales(path, 3, 2, 4)
    for a, b in zip(got[:4], (k, v, k_mean, v_mean), strict=True):
        torch.testing.assert_close(a, b)
    assert got.k_rotation is None
    with pytest.raises(KVScalesError, match="k_mean must be 3 x 2 lists of 8 numbers"):
        load_kv_scales(path, 3, 2, 8)
    # A v1 file (scales only) still loads: no means, the pool stores uncentred values.
    save_kv_scales(path, KVScales(k, v))
    doc = json.loads(path.read_text())
    assert "k_mean" not in doc
    doc["format"] = "radixlm-kv-scales-v1"
    path.write_text(json.dumps(doc))
    k2, v2, km, vm, rotation = load_kv_scales(path, 3, 2, 4)
    torch.testing.assert_close(k2, k) and torch.testing.assert_close(v2, v)
    assert km is None and vm is None and rotation is None
    # The key rotation round-trips; an unknown one, or one the head dim cannot take, is refused.
    save_kv_scales(path, KVScales(k, v, k_mean, v_mean, "hadamard"))
    assert json.loads(path.read_text())["k_rotation"] == "hadamard"
    assert load_kv_scales(path, 3, 2, 4).k_rotation == "hadamard"
    save_kv_scales(path, KVScales(k, v, None, None, "hadamard"))
    with pytest.raises(KVScalesError, match="needs a power-of-two head dim, the model's is 6"):
        load_kv_scales(path, 3, 2, 6)
    doc = json.loads(path.read_text())
    doc["k_rotation"] = "givens"
    path.write_text(json.dumps(doc))
    with pytest.raises(KVScalesError, match="k_rotation must be one of"):
        load_kv_scales(path, 3, 2, 4)
    # Means come in pairs; booleans are not numbers; a subnormal scale would overflow x / scale.
    for edit, message in (
        (lambda d: d.pop("v_mean"), "v_mean is missing"),
        (lambda d: d["k_mean"][0][0].__setitem__(0, True), "k_mean must be 3 x 2 lists of 4 numbers"),
        (lambda d: d["v_scale"][0].__setitem__(0, 1e-45), "every v_scale must be a finite number > 0"),
    ):
        save_kv_scales(path, KVScales(k, v, k_mean, v_mean))
        doc = json.loads(path.read_text())
        edit(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(KVScalesError, match=message):
            load_kv_scales(path, 3, 2, 4)
    save_kv_scales(path, KVScales(k, v))
    with pytest.raises(KVScalesError, match="k_scale must be 4 lists of 2"):
        load_kv_scales(path, 4, 2)
    doc = json.loads(path.read_text())
    doc["v_scale"][1][0] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(KVScalesError, match="every v_scale must be a finite number > 0"):
        load_kv_scales(path, 3, 2)
    path.write_text("{}")
    with pytest.raises(KVScalesError, match=r"not a radixlm-kv-scales-v2 \(or v1\) file"):
        load_kv_scales(path, 3, 2)
    with pytest.raises(KVScalesError, match="cannot read JSON"):
        load_kv_scales(tmp_path / "missing.json", 3, 2)


def test_kv_cache_flags(capsys) -> None:
    args = ServerArgs.parse(["--kv-cache-dtype", "fp8_e4m3", "--kv-scales-path", "s.json"])
    assert (args.kv_cache_dtype, args.kv_scales_path) == ("fp8_e4m3", "s.json")
    assert ServerArgs.parse([]).kv_cache_dtype == "auto"
    for argv, message in (
        (["--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
        (
            ["--kv-scales-path", "s.json"],
            "--kv-scales-path only applies to --kv-cache-dtype fp8_e4m3",
        ),
    ):
        with pytest.raises(SystemExit):
            ServerArgs.parse(argv)
        assert message in capsys.readouterr().err


def test_runner_refuses_to_start_with_unusable_scales(smollm2_dir: str, tmp_path: Path) -> None:
    from radixlm.runtime.executor.model_runner import ModelRunner

    path = tmp_path / "scales.json"
    save_kv_scales(path, KVScales(torch.full((30, 3), 0.01), torch.full((30, 3), 0.01)))
    doc = json.loads(path.read_text())
    doc["k_scale"][7][1] = float("inf")
    path.write_text(json.dumps(doc).replace("Infinity", "1e999"))
    args = ServerArgs(model_path=smollm2_dir, device="cpu", kv_cache_dtype="fp8_e4m3",
                      kv_scales_path=str(path), max_total_tokens=256)  # fmt: skip
    with pytest.raises(KVScalesError, match="every k_scale must be a finite number > 0"):
        ModelRunner(args)
    save_kv_scales(path, KVScales(torch.full((30, 3), 0.01), torch.full((30, 3), 0.02),
                                  torch.zeros(30, 3, 64), torch.full((30, 3, 64), 0.5)))  # fmt: skip
    runner = ModelRunner(args)
    assert runner.pool.dtype == FP8 and float(runner.pool.v_scale[29][2]) == pytest.approx(0.02)
    assert float(runner.pool.v_mean[29][2, 63]) == 0.5
    assert runner.pool.bytes_per_token == 30 * 3 * 64 * 2


@pytest.mark.slow
def test_calibrate_kv_scales_command_writes_what_the_server_calibrates(smollm2_dir: str, tmp_path: Path,
                                                                         capsys) -> None:  # fmt: skip
    """`radixlm calibrate_kv_scales --out F` writes the scales, channel means and rotation the
    server measures at start-up (same model, device and dtype), so a server given
    ``--kv-scales-path F`` builds the same pool; ``--text`` calibrates on other text."""
    from radixlm.runtime.cli import main as cli
    from radixlm.runtime.executor.model_runner import ModelRunner

    path = tmp_path / "scales.json"
    with pytest.raises(SystemExit) as exit_:
        cli(["calibrate_kv_scales", "--out", str(path), "--model-path", smollm2_dir, "--device", "cpu"])
    assert exit_.value.code == 0
    assert "1627 tokens of" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert (doc["num_layers"], doc["num_kv_heads"], doc["head_dim"], doc["k_rotation"]) == (30, 3, 64, "hadamard")
    base = dict(model_path=smollm2_dir, device="cpu", kv_cache_dtype="fp8_e4m3", max_total_tokens=256)
    calibrated = ModelRunner(ServerArgs(**base)).pool
    loaded = ModelRunner(ServerArgs(**base, kv_scales_path=str(path))).pool
    for name in ("k_scale", "v_scale", "k_mean", "v_mean"):
        torch.testing.assert_close(torch.stack(getattr(loaded, name)), torch.stack(getattr(calibrated, name)))
    assert loaded.k_rotation == calibrated.k_rotation == "hadamard"

    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return [i * i for i in range(x)]\n" * 20)
    assert kv_main(["--out", str(path), "--model-path", smollm2_dir, "--device", "cpu", "--text", str(text)]) == 0
    other = load_kv_scales(path, 30, 3, 64)
    assert not torch.allclose(other.k_scale, torch.stack(calibrated.k_scale).cpu())
    capsys.readouterr()
    text.write_text("")  # no tokens: a message, status 1, the file left as it was
    assert kv_main(["--out", str(path), "--model-path", smollm2_dir, "--device", "cpu", "--text", str(text)]) == 1
    assert "needs at least one token" in capsys.readouterr().err
    assert torch.equal(load_kv_scales(path, 30, 3, 64).k_scale, other.k_scale)
    text.write_text("the moon " * 5000)  # 10,000 tokens, over SmolLM2's 8192
    assert kv_main(["--out", str(path), "--model-path", smollm2_dir, "--device", "cpu", "--text", str(text)]) == 1
    assert "over the model's context length 8192" in capsys.readouterr().err
    assert kv_main(["--out", str(path), "--model-path", str(tmp_path / "nowhere"), "--device", "cpu"]) == 1
    assert "nowhere" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        kv_main(["--out", str(path), "--text", str(tmp_path / "missing.txt")])
    assert exit_.value.code == 2 and "missing.txt" in capsys.readouterr().err
