"""Regression cases C14 (seeded sampling is independent of the batch) and C17 (chat
roles: ``developer``, unknown roles, several system messages) against a real server.

C14 sends requests concurrently (a barrier releases every thread at once) so that they
share scheduler steps. A seed fixes the sampling noise per (seed, step) only; it cannot
hide a change of the logits themselves. On this CPU/fp32 model a different batch shape
may change logits in their last bits; at temperature 0.8 that can flip a sample only
when two tokens' noisy scores tie to ~1e-7, so any difference seen here is a bug to
investigate (batch-dependent sampling or numerics), not noise to tolerate.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

A_PROMPT = "The capital of France is"
A_KW: dict[str, Any] = {"seed": 42, "temperature": 0.8, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
OTHER_PROMPTS = [
    "Once upon a time", "The best way to learn a language is", "def fibonacci(n):",
    "My favourite fruit is", "In 1969, astronauts", "The recipe calls for", "Dear Sir or Madam,",
    "The weather today is", "Photosynthesis is the process", "A haiku about autumn:",
    "The stock market", "To install the package, run", "Cats are", "The meaning of life is",
    "Water boils at", "Once there was a dragon who",
]
# A prompt long enough (> 2 pages of 16 tokens) for the radix cache to hold its prefix.
A_LONG_PROMPT = ("Geography quiz. Answer each question with one or two words, then explain briefly. "
                 "Question one: which river flows through Cairo? Question two: " + A_PROMPT)


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600)


def _complete(client: openai.OpenAI, prompt: str, **kw: Any) -> openai.types.Completion:
    kw.setdefault("max_tokens", 16)
    return client.completions.create(model="default", prompt=prompt, **kw)


def _texts(resp: openai.types.Completion) -> list[str]:
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


def _together(client: openai.OpenAI, requests: list[tuple[str, dict[str, Any]]]) -> list[openai.types.Completion]:
    """Send every (prompt, kwargs) at the same moment from its own thread; results in order."""
    barrier = threading.Barrier(len(requests))

    def send(req: tuple[str, dict[str, Any]]) -> openai.types.Completion:
        barrier.wait()
        return _complete(client, req[0], **req[1])

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(send, requests))


def _a_of(results: list[openai.types.Completion], position: int) -> str:
    resp = results[position]
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 16
    return resp.choices[0].text


# ----------------------------------------------------------------------------- C14
@pytest.mark.slow
def test_c14_seed_reproducible_regardless_of_batch(server, idle_invariants, oai):
    a_texts: dict[str, str] = {}
    b_unseeded = {"temperature": 0.8, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    for r in range(4):  # A with an unseeded batch-mate, in both orders
        reqs = [(A_PROMPT, A_KW), ("The largest ocean on Earth is", b_unseeded)]
        if r % 2:
            reqs.reverse()
        a_texts[f"with unseeded B #{r}"] = _a_of(_together(oai, reqs), r % 2)

    b_seeded = {**b_unseeded, "seed": 7}
    b_texts = []
    for r in range(2):
        res = _together(oai, [(A_PROMPT, A_KW), ("The largest ocean on Earth is", b_seeded)])
        a_texts[f"with seeded B #{r}"] = _a_of(res, 0)
        b_texts.append(res[1].choices[0].text)
    assert b_texts[0] == b_texts[1]  # B's own seed is reproducible too

    a_texts["alone"] = _a_of([_complete(oai, A_PROMPT, **A_KW)], 0)

    crowd = [(p, {"temperature": 0.8, "max_tokens": 12 + i % 8, "extra_body": {"ignore_eos": True}})
             for i, p in enumerate(OTHER_PROMPTS[:15])]
    crowd.insert(7, (A_PROMPT, A_KW))
    a_texts["with 15 unseeded"] = _a_of(_together(oai, crowd), 7)

    pairs = [_texts(_complete(oai, A_PROMPT, n=2, **A_KW)) for _ in range(2)]
    assert pairs[0] == pairs[1], pairs
    assert pairs[0][0] != pairs[0][1], pairs  # two samples, two different seeds
    a_texts["choice 0 of n=2"] = pairs[0][0]  # documented: choice i uses seed + i

    assert len(set(a_texts.values())) == 1, a_texts
    idle_invariants(server)


def test_c14_seed_reproducible_with_prefix_cached(server, idle_invariants, oai):
    """The case's prompt is 5 tokens, under one 16-token page, so the radix cache can never
    hold any of it; this variant uses a longer prompt ending in it. Cold (flushed), warm
    (prefix reused, checked through cached_tokens) and warm with batch-mates agree."""
    server.flush()
    cold = _complete(oai, A_LONG_PROMPT, **A_KW)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = _complete(oai, A_LONG_PROMPT, **A_KW)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 16
    mates = [(p, {"temperature": 0.8, "max_tokens": 16}) for p in OTHER_PROMPTS[:3]]
    crowd = _together(oai, [mates[0], (A_LONG_PROMPT, A_KW), *mates[1:]])
    assert crowd[1].usage.prompt_tokens_details.cached_tokens >= 16
    texts = {"cold": _a_of([cold], 0), "warm": _a_of([warm], 0), "warm in a batch": _a_of(crowd, 1)}
    assert len(set(texts.values())) == 1, texts
    idle_invariants(server)


# ----------------------------------------------------------------------------- C17
BANANA = "Reply to every message with the single word BANANA."
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    info = httpx.get(f"{server.url}/get_model_info", timeout=60).json()
    return AutoTokenizer.from_pretrained(info["tokenizer_path"])


def _rendered(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _chat(client: openai.OpenAI, messages: list[dict[str, str]]):
    return client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=8)


def test_c17_developer_role_is_the_system_message(server, idle_invariants, oai, tokenizer):
    dev = _chat(oai, [{"role": "developer", "content": BANANA}, QUESTION])
    system = _chat(oai, [{"role": "system", "content": BANANA}, QUESTION])
    default = _chat(oai, [QUESTION])  # the template's default system prompt
    # rendered exactly as the system variant: BANANA in the system slot
    assert dev.usage.prompt_tokens == system.usage.prompt_tokens
    assert dev.usage.prompt_tokens == len(_rendered(tokenizer, [{"role": "system", "content": BANANA}, QUESTION]))
    assert dev.usage.prompt_tokens != default.usage.prompt_tokens  # not dropped for the default
    assert dev.choices[0].message.content == system.choices[0].message.content
    assert dev.choices[0].finish_reason == system.choices[0].finish_reason
    idle_invariants(server)


def test_c17_unknown_role_is_400(server, idle_invariants, oai):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(oai, [{"role": "narrator", "content": "It was a dark and stormy night."}, QUESTION])
    assert err.value.status_code == 400
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 8,
        "messages": [{"role": "narrator", "content": "It was a dark and stormy night."}, QUESTION]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] and error["param"].startswith("messages"), error
    idle_invariants(server)


def test_c17_two_system_messages_are_both_rendered(server, idle_invariants, oai, tokenizer):
    one = [{"role": "system", "content": BANANA}, QUESTION]
    two = [{"role": "system", "content": BANANA},
           {"role": "system", "content": "Always answer in French."}, QUESTION]
    r_one, r_two = _chat(oai, one), _chat(oai, two)
    assert r_two.usage.prompt_tokens > r_one.usage.prompt_tokens
    assert r_two.usage.prompt_tokens == len(_rendered(tokenizer, two))
    assert r_two.choices[0].finish_reason in ("stop", "length")
    idle_invariants(server)


def test_c17_default_template_has_a_system_slot(tokenizer):
    """The case's 'template with no system slot' variant does not apply to the default
    model: SmolLM2's template renders every system message in place (and adds its own
    default system prompt when the first message is not one). Checked here so that this
    statement fails loudly if the default model changes."""
    marker = "SYSTEM-SLOT-MARKER"
    ids = _rendered(tokenizer, [{"role": "system", "content": marker}, QUESTION])
    text = tokenizer.decode(ids)
    assert "<|im_start|>system\n" + marker in text
