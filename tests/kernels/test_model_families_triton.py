"""The model families on the Triton attention backend (interpreter on the CPU) give the torch
backend's logits: a 12-token prefill then a decode step over 4-token pages.

Covers the fused layer path with q/k norm and MoE blocks (Qwen3-MoE) and with the PyTorch
RoPE (Phi-3's partial LongRoPE), and the plain layer path over the Triton backend with its
reference fallback for soft-capping (Gemma 2) and for sliding windows shorter than the
sequence (Mistral, window 8 < 13 tokens).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from radixlm.runtime.executor.model_loader import load_model  # noqa: E402

from ..runtime.executor.test_model import Session  # noqa: E402
from ..runtime.executor.test_model_families import hf_family_model  # noqa: E402
from .conftest import DEVICE  # noqa: E402


@pytest.mark.parametrize(("family", "fused"), [("qwen3_moe", True), ("phi3", True), ("gemma2", False),
                                               ("mistral", True)])  # fmt: skip
def test_family_on_the_triton_backend_matches_torch(tmp_path, family: str, fused: bool) -> None:
    hf_family_model(family, tmp_path)
    models = {name: load_model(tmp_path, torch.float32, DEVICE, name) for name in ("torch", "triton")}
    assert models["triton"].model.fused == fused
    ids = random.Random(0).choices(range(3, 256), k=13)
    logits = {}
    for name, model in models.items():
        session = Session(model, page_size=4, device=DEVICE)
        first = session.step({0: (ids[:12], 0)})[0]
        logits[name] = torch.cat([first, session.step({0: (ids[12:], 12)})[0]])
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-5, rtol=2e-5)
