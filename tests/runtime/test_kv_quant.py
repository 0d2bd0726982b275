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

from radixlm.runtime.kv_calibration import (
    KVScalesError,
    calibrate_kv_scales,
    load_kv_scales,
    save_kv_scales,
)
from radixlm.runtime.memory_pool import KVPool, kv_bytes_per_token
from radixlm.runtime.model_loader import load_model
from radixlm.runtime.server_args import ServerArgs

from .test_model import Session, full_logits

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


def test_calibration_scales_are_twice_the_absmax_over_448(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    ids = random.Random(5).choices(range(256), k=37)
    k_scales, v_scales = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32)
    assert k_scales.shape == v_scales.shape == (2, 2)
    # The same K/V, stored by a plain forward pass into a float pool.
    session = Session(model, page_size=4)
    session.step({0: (ids, 0)})
    pages = session.tables[0]
    for layer in range(2):
        k = session.pool.k[layer][pages].reshape(-1, 2, 16)[:37]
        v = session.pool.v[layer][pages].reshape(-1, 2, 16)[:37]
        torch.testing.assert_close(k_scales[layer], k.abs().amax(dim=(0, 2)) * 2 / 448)
        torch.testing.assert_close(v_scales[layer], v.abs().amax(dim=(0, 2)) * 2 / 448)
    with pytest.raises(KVScalesError, match="at least one token"):
        calibrate_kv_scales(model, [], 4, "cpu", torch.float32)


def test_fp8_cache_logits_stay_close_to_the_float_cache(tiny_hf_model: Callable) -> None:
    """Chunked prefill + decode on FP8 pages (torch backend): logits within a few percent
    of the float cache's, but not identical (the cache really is quantised)."""
    model = load_model(tiny_hf_model()[0], torch.float32, "cpu", "torch")
    ids = random.Random(6).choices(range(256), k=30)
    scales = calibrate_kv_scales(model, ids, 4, "cpu", torch.float32)
    session = Session(model, page_size=4)
    session.pool = KVPool(64, 4, 2, 2, 16, torch.float32, "cpu", "fp8_e4m3", *scales)
    got = [session.step({0: (ids[:20], 0)})[0]] + [
        session.step({0: ([ids[t]], t)})[0] for t in range(20, 30)
    ]
    got_t, ref = torch.cat(got), full_logits(model, ids)
    err = float((got_t - ref).norm() / ref.norm())
    assert 1e-4 < err < 0.05, err


def test_scales_file_round_trip_and_errors(tmp_path: Path) -> None:
    k, v = torch.rand(3, 2) + 0.1, torch.rand(3, 2) + 0.1
    path = tmp_path / "scales.json"
    save_kv_scales(path, k, v)
    k2, v2 = load_kv_scales(path, 3, 2)
    torch.testing.assert_close(k2, k) and torch.testing.assert_close(v2, v)
    with pytest.raises(KVScalesError, match="k_scale must be 4 lists of 2"):
        load_kv_scales(path, 4, 2)
    doc = json.loads(path.read_text())
    doc["v_scale"][1][0] = 0
    path.write_text(json.dumps(doc))
    with pytest.raises(KVScalesError, match="every v_scale must be a finite number > 0"):
        load_kv_scales(path, 3, 2)
    path.write_text("{}")
    with pytest.raises(KVScalesError, match="not a radixlm-kv-scales-v1 file"):
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
    from radixlm.runtime.model_runner import ModelRunner

    path = tmp_path / "scales.json"
    save_kv_scales(path, torch.full((30, 3), 0.01), torch.full((30, 3), 0.01))
    doc = json.loads(path.read_text())
    doc["k_scale"][7][1] = float("inf")
    path.write_text(json.dumps(doc).replace("Infinity", "1e999"))
    args = ServerArgs(model_path=smollm2_dir, device="cpu", kv_cache_dtype="fp8_e4m3",
                      kv_scales_path=str(path), max_total_tokens=256)  # fmt: skip
    with pytest.raises(KVScalesError, match="every k_scale must be a finite number > 0"):
        ModelRunner(args)
    save_kv_scales(path, torch.full((30, 3), 0.01), torch.full((30, 3), 0.02))
    runner = ModelRunner(args)
    assert runner.pool.dtype == FP8 and float(runner.pool.v_scale[29][2]) == pytest.approx(0.02)
    assert runner.pool.bytes_per_token == 30 * 3 * 64 * 2
