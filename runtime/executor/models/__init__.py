"""Model implementations, looked up by the ``architectures`` name in config.json."""

from __future__ import annotations

from radixlm.runtime.executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "Qwen2ForCausalLM"]

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
