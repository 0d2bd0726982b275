"""Every supported model family end to end on the CPU against transformers.

Per family: a tiny random-weight config saved as a Hugging Face directory, served in
process (``LocalServer``: scheduler, radix cache, paged KV pool with 16-token pages, the
torch attention backend) and run by transformers (float32, eager attention):

- prompt logprobs within 1e-4 of transformers' log-softmax;
- 32 greedy tokens identical to transformers' ``generate``;
- the same request again is served from the radix cache (``cached_tokens`` > 0) with the
  same tokens and prompt logprobs;
- families with a sliding window get one (8) shorter than the 40-token prompt, so prefill,
  the cached-prefix extend and every decode step mask keys behind the window.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime.engine import LocalServer
from radixlm.runtime.server_args import ServerArgs

PROMPT_LEN, NEW_TOKENS, WINDOW = 40, 32, 8
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
_MOE = dict(num_experts_per_tok=2)
# family -> (transformers config class, config overrides). Sliding windows where the family has one.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, moe_intermediate_size=32, norm_topk_prob=True,
                                         num_hidden_layers=3, mlp_only_layers=[1], **_MOE)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, sliding_window=WINDOW, **_MOE)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                        num_hidden_layers=3, sliding_window_pattern=3,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 5000.0}},
                                        tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, max_position_embeddings=512,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                 "long_factor": [2.0 + 0.3 * i for i in range(6)],
                                                 "original_max_position_embeddings": 128,
                                                 "partial_rotary_factor": 0.75})),
}  # fmt: skip


def hf_family_model(family: str, out: Path) -> torch.nn.Module:
    """Build, randomise (non-zero norms and biases) and save the tiny ``family`` model."""
    import transformers

    config_name, overrides = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_BASE, **overrides})
    config._attn_implementation = "eager"  # soft-capping and windows exactly as written
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15) + (0.5 if "norm" in name else 0.0))
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """(family, transformers model, an in-process server of the same weights)."""
    family = request.param
    out = tmp_path_factory.mktemp(family)
    hf = hf_family_model(family, out)
    args = ServerArgs(model_path=str(out), tokenizer_path=smollm2_dir, device="cpu", dtype="float32",
                      attention_backend="torch", max_total_tokens=1024, max_running_requests=4,
                      log_level="warning", debug_invariants=True)  # fmt: skip
    with LocalServer(args) as server:
        yield family, hf, server


def _prompt(seed: int = 0) -> list[int]:
    return random.Random(seed).choices(range(3, 256), k=PROMPT_LEN)


def _generate(server: LocalServer, ids: list[int], logprob_start: int | None = None) -> dict:
    """Greedy ``NEW_TOKENS``; prompt logprobs from position ``logprob_start`` when given
    (the prompt before it may come from the radix cache; the rest is computed)."""
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}  # fmt: skip
    if logprob_start is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_start)
    return server.post("/generate", body)


def _hf_prompt_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[L - 1] log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _hf_greedy(hf: torch.nn.Module, ids: list[int]) -> list[int]:
    """``NEW_TOKENS`` argmax tokens through transformers' KV cache (no logits processor:
    ``generate``'s ``min_new_tokens`` would ban the EOS id the server produces under
    ``ignore_eos``)."""
    out_ids: list[int] = []
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            out_ids.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([out_ids[-1:]]), cache=out.past_key_values, use_cache=True)
    return out_ids


def _prompt_logprobs(out: dict) -> torch.Tensor:
    """The served prompt logprobs, [positions from logprob_start_len]."""
    triples = out["meta_info"]["input_token_logprobs"]
    return torch.tensor([t[0] if t[0] is not None else float("nan") for t in triples], dtype=torch.float32)


def test_matches_transformers_with_and_without_the_radix_cache(served) -> None:
    """Prompt logprobs and greedy tokens as transformers'; the same prompt again takes its
    two full pages from the radix cache and gives the same tokens and logprobs for the
    positions computed after them."""
    family, hf, server = served
    ids = _prompt()
    expected_logprobs, expected_ids = _hf_prompt_logprobs(hf, ids), _hf_greedy(hf, ids)  # positions 1..
    first = _generate(server, ids, logprob_start=0)
    assert first["meta_info"]["cached_tokens"] == 0
    got = _prompt_logprobs(first)[1:]
    assert got.shape == expected_logprobs.shape
    assert (got - expected_logprobs).abs().max().item() < 1e-4, family
    assert first["output_ids"] == expected_ids, family

    _generate(server, ids)  # computes and caches the prompt (prompt logprobs from 0 bypass the cache)
    start = PROMPT_LEN - 6
    second = _generate(server, ids, logprob_start=start)
    assert second["meta_info"]["cached_tokens"] == 32, second["meta_info"]  # two full 16-token pages
    assert second["output_ids"] == expected_ids, family
    assert (_prompt_logprobs(second) - expected_logprobs[start - 1 :]).abs().max().item() < 1e-4, family
