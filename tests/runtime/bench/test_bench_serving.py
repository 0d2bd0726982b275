"""The serving benchmark on CPU without a server: workloads, arrivals, metrics, multi-turn
replay against a fake client, plots, and the transformers baselines on a tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from radixlm.runtime.bench import serving as bs
from radixlm.runtime.bench.datasets import (
    BenchRequest,
    Conversation,
    MooncakeWindow,
    RequestOutput,
    mooncake_requests,
    multiturn_conversations,
    poisson_gaps,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from radixlm.runtime.bench.serving import compute_metrics


class WordTokenizer:
    """One token per whitespace-separated word; chat template ``role: content`` lines."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


# ----------------------------------------------------------------------------- datasets
def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    reqs = shared_prefix_requests(3, 4, system_prompt_len=10, question_len=5, output_len=7,
                                  seed=2)
    assert len(reqs) == 12
    assert {r.prompt_len for r in reqs} == {15} and {len(r.prompt) for r in reqs} == {15}
    assert {r.output_len for r in reqs} == {7}
    groups = {g: [r.prompt for r in reqs if r.group == g] for g in range(3)}
    assert [len(p) for p in groups.values()] == [4, 4, 4]
    for prompts in groups.values():
        assert len({p[:10] for p in prompts}) == 1  # one system prompt per group
        assert len({p[10:] for p in prompts}) == 4  # four distinct questions
    assert len({prompts[0][:10] for prompts in groups.values()}) == 3
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled
    assert shared_prefix_requests(3, 4, 10, 5, 7, seed=2) == reqs


def test_random_lengths_span_the_range_and_ids_the_vocab() -> None:
    reqs = random_requests(400, input_len=100, output_len=50, range_ratio=0.5, vocab_size=300,
                           seed=1)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert (min(ins), max(ins)) == (50, 100)
    assert (min(outs), max(outs)) == (25, 50)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    ids = [t for r in reqs for t in r.prompt]
    assert min(ids) >= 0 and max(ids) == 299
    fixed = random_requests(5, 8, 3, 1.0, 300, seed=1)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(8, 3)}
    zero = random_requests(200, 10, 10, 0.0, 300, seed=1)
    assert min(r.prompt_len for r in zero) == 1
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 8, 3, 1.5, 300)


def _record(prompt_words: int, reply_words: int, extra_messages: int = 0) -> dict:
    msgs = [{"from": "human", "value": "p " * prompt_words},
            {"from": "gpt", "value": "r " * reply_words}]
    return {"id": f"{prompt_words}-{reply_words}", "conversations": msgs + msgs[:extra_messages]}


def test_sharegpt_filter_and_output_len() -> None:
    records = [
        _record(10, 20),
        _record(3, 20),  # prompt < 4 tokens
        _record(10, 3),  # output < 4 tokens
        _record(1025, 10),  # prompt > 1024
        _record(1000, 1049),  # prompt + output > 2048
        {"id": "x", "conversations": [{"from": "human", "value": "p p p p p"}]},  # 1 message
        _record(1000, 1048),
        _record(4, 4),
    ]
    reqs = sharegpt_requests(records, WordTokenizer(), num_prompts=3, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(4, 4), (10, 20), (1000, 1048)]
    assert all(isinstance(r.prompt, str) for r in reqs)
    with pytest.raises(ValueError, match="only 3 ShareGPT conversations"):
        sharegpt_requests(records, WordTokenizer(), num_prompts=4)
    # a context length replaces the 1024 / 2048 limits; a fixed output length is kept
    ctx = sharegpt_requests(records, WordTokenizer(), 5, seed=0, output_len=9, context_len=3000)
    assert sorted(r.prompt_len for r in ctx) == [4, 10, 1000, 1000, 1025]
    assert {r.output_len for r in ctx} == {9}
    other = sharegpt_requests(records, WordTokenizer(), 3, seed=5)
    assert sorted(other, key=lambda r: r.prompt_len) == sorted(reqs, key=lambda r: r.prompt_len)


def test_multiturn_conversations_from_a_file(tmp_path: Path) -> None:
    def chat(cid: str, *pairs: tuple[str, str]) -> dict:
        msgs = [{"from": who, "value": text} for pair in pairs
                for who, text in zip(("human", "gpt"), pair, strict=True)]
        return {"id": cid, "conversations": msgs}

    path = tmp_path / "sharegpt.jsonl"
    records = [chat("a_0", ("u1", "r r"), ("u2", "r r r")), chat("b_0", ("v1", "r")),
               chat("a_2", ("u3", "r r r r"))]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    convs = multiturn_conversations(WordTokenizer(), 2, seed=0, dataset_path=str(path))
    assert sorted(convs, key=lambda c: len(c.users)) == [
        Conversation(("v1",), (1,)),
        Conversation(("u1", "u2", "u3"), (2, 3, 4)),  # split records joined back in order
    ]
    short = multiturn_conversations(WordTokenizer(), 2, 0, max_turns=2, output_len=5,
                                    dataset_path=str(path))
    assert sorted(c.output_lens for c in short) == [(5,), (5, 5)]


# ----------------------------------------------------------------------------- arrivals
def test_mooncake_requests_share_blocks_scale_lengths_and_keep_times(tmp_path: Path) -> None:
    lines = [  # conversation 8 (its second block): two turns; conversation 3; a 1-block prompt
        {"timestamp": 1000, "input_length": 1100, "output_length": 64, "hash_ids": [0, 8, 9]},
        {"timestamp": 2000, "input_length": 700, "output_length": 10, "hash_ids": [0, 3]},
        {"timestamp": 4000, "input_length": 1600, "output_length": 1, "hash_ids": [0, 8, 9, 11]},
        {"timestamp": 5000, "input_length": 300, "output_length": 32, "hash_ids": [0]},
        {"timestamp": 9000, "input_length": 2000, "output_length": 64, "hash_ids": [0, 8, 12, 13]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    window = MooncakeWindow(start_s=1.0, duration_s=7.0, sample=1, time_scale=2.0, block_tokens=16)
    reqs = mooncake_requests(str(path), window, vocab=1000, seed=5)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5, 2.0]  # (t - 1 s) / 2; 9 s is out
    # lengths x 16 / 512, at least 1: 1100 -> 34, 700 -> 22, 1600 -> 50, 300 -> 9
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(34, 2), (22, 1), (50, 1), (9, 1)]
    assert all(len(r.prompt) == r.prompt_len and max(r.prompt) < 1000 for r in reqs)
    first, other, turn2, single = reqs
    assert turn2.prompt[:34] == first.prompt[:34]  # blocks 0, 8 and the start of 9
    assert other.prompt[:16] == first.prompt[:16] and other.prompt[16:] != first.prompt[16:22]
    assert single.prompt == first.prompt[:9]
    assert mooncake_requests(str(path), window, vocab=1000, seed=5) == reqs
    longer = dataclasses.replace(window, output_scale=0.25)  # outputs 64, 10, 1, 32 x 1/4
    assert [r.output_len for r in mooncake_requests(str(path), longer, 1000)] == [16, 2, 1, 8]
    halves = MooncakeWindow(start_s=0.0, duration_s=100.0, sample=2, block_tokens=16)
    kept = mooncake_requests(str(path), halves, vocab=1000)
    # second block 8 kept (both turns and the later one), 3 dropped; the 1-block prompt
    # is request 3 of the file: odd, dropped
    assert [r.arrival_s for r in kept] == [1.0, 4.0, 9.0]


def test_trace_requests_are_sent_at_their_own_times() -> None:
    class Recorder:
        backend, sent = "radixlm", []

        async def send(self, call: bs.Call) -> RequestOutput:
            self.sent.append((call.prompt, time.perf_counter()))
            return RequestOutput(True, prompt_len=call.prompt_len, output_len=call.output_len)

    client = Recorder()
    calls = [bs.Call((i,), None, 1, 1) for i in range(3)]
    with tqdm(disable=True) as bar:
        start = time.perf_counter()
        asyncio.run(bs._run_requests(client, calls, math.inf, 0, bar, arrivals=[0.0, 0.2, 0.1]))
    offsets = [t - start for _, t in client.sent]
    assert [p for p, _ in client.sent] == [(0,), (1,), (2,)]  # in list order
    assert 0.19 <= offsets[1] < 0.4 and offsets[2] >= offsets[1]  # a late one goes at once


def test_poisson_gaps_are_exponential_and_seeded() -> None:
    gaps = poisson_gaps(10.0, seed=3)
    sample = [next(gaps) for _ in range(20000)]
    assert statistics.fmean(sample) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(sample) == pytest.approx(0.1, rel=0.05)  # exponential: std = mean
    # arrivals per 1 s window: Poisson(10), mean = variance
    times, t = [], 0.0
    for g in sample:
        t += g
        times.append(t)
    counts = [0] * int(times[-1])
    for x in times:
        if int(x) < len(counts):
            counts[int(x)] += 1
    assert statistics.fmean(counts) == pytest.approx(10, rel=0.05)
    assert statistics.pvariance(counts) == pytest.approx(10, rel=0.15)
    again = poisson_gaps(10.0, seed=3)
    assert [next(again) for _ in range(5)] == sample[:5]
    everything_now = poisson_gaps(math.inf)
    assert [next(everything_now) for _ in range(3)] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        next(poisson_gaps(0.0))


# ----------------------------------------------------------------------------- metrics
def test_metrics_on_hand_computed_timings() -> None:
    outputs = [
        RequestOutput(True, prompt_len=10, output_len=4, ttft=0.1, itl=[0.02, 0.03, 0.05],
                      latency=0.2),
        RequestOutput(True, prompt_len=20, output_len=2, ttft=0.3, itl=[0.1], latency=0.4),
        RequestOutput(False, prompt_len=99, output_len=0, error="boom"),
    ]
    m = compute_metrics(outputs, duration_s=0.5, max_concurrency_reached=3)
    assert (m["completed"], m["failed"], m["max_concurrency_reached"]) == (2, 1, 3)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(4.0)
    assert m["input_throughput"] == pytest.approx(60.0)
    assert m["output_throughput"] == pytest.approx(12.0)
    assert m["total_throughput"] == pytest.approx(72.0)
    assert m["concurrency"] == pytest.approx(1.2)  # (0.2 + 0.4) / 0.5
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(100.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # 100 + 0.99 * 200
    # TPOT: (0.2 - 0.1) / 3 and (0.4 - 0.3) / 1
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    # ITL over all gaps [20, 30, 50, 100] ms
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p99_itl_ms"] == pytest.approx(98.5)  # 50 + 0.97 * 50
    assert m["mean_e2e_latency_ms"] == pytest.approx(300.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(398.0)


def test_metrics_without_streaming_are_null_not_zero() -> None:
    outputs = [RequestOutput(True, prompt_len=5, output_len=8, latency=2.0)]
    m = compute_metrics(outputs, 2.0, 1)
    for name in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p99"):
            assert m[f"{stat}_{name}_ms"] is None
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(2000.0)


def test_server_hit_rate_is_a_counter_delta() -> None:
    text = (
        '# TYPE radixlm:prompt_tokens_total counter\n'
        'radixlm:prompt_tokens_total{model_name="m"} 1000.0\n'
        '# TYPE radixlm:cached_tokens_total counter\n'
        'radixlm:cached_tokens_total{model_name="m"} 300.0\n'
        '# TYPE radixlm:kv_cache_usage gauge\n'
        'radixlm:kv_cache_usage{model_name="m"} 0.25\n'
    )
    values = bs.parse_prometheus(text)
    assert values["radixlm:prompt_tokens_total"] == 1000.0
    assert values["radixlm:kv_cache_usage"] == 0.25
    stats = bs.ServerStats(client=None, base_url="http://x")
    stats.before = values
    stats.kv_samples = [0.25, 0.75]
    stats.waste_samples = [0.01, 0.03]
    stats.running_samples = [4.0, 8.0]
    after = {**values, "radixlm:prompt_tokens_total": 3000.0, "radixlm:cached_tokens_total": 1800.0}
    assert stats.summary(after) == {
        "prefix_cache_hit_rate": pytest.approx(0.75),  # 1500 cached of 2000 new prompt tokens
        "kv_usage_mean": 0.5,
        "kv_usage_max": 0.75,
        "kv_waste_mean": pytest.approx(0.02),
        "kv_waste_max": 0.03,
        "running_reqs_mean": 6.0,
        "running_reqs_max": 8.0,
    }
    stats.before = None
    assert stats.summary(after)["prefix_cache_hit_rate"] is None


def test_timer_spreads_a_chunk_of_k_tokens_over_k_gaps(monkeypatch) -> None:
    clock = iter([0.0, 0.5, 0.8, 1.4, 2.0])
    monkeypatch.setattr(bs.time, "perf_counter", lambda: next(clock))
    out = RequestOutput()
    timer = bs._Timer(out)  # t = 0
    timer.chunk(2)  # 0.5: first tokens -> TTFT, no gap
    timer.chunk(1)  # 0.8
    timer.chunk(3)  # 1.4: 3 tokens in 0.6 s
    timer.done()  # 2.0
    assert out.ttft == 0.5 and out.latency == 2.0 and out.success
    assert out.itl == pytest.approx([0.3, 0.2, 0.2, 0.2])


# ----------------------------------------------------------------------------- multi-turn
class FakeClient:
    """Records each call; replies "reply-<conversation>-<turn>" after a short await."""

    def __init__(self, backend: str) -> None:
        self.backend, self.calls, self.order = backend, [], []

    async def send(self, call: bs.Call) -> RequestOutput:
        first_user = (call.messages or [{}])[0].get("content") if call.messages else call.prompt
        conv = first_user.split()[0] if call.messages else call.prompt.split()[1]
        turn = sum(1 for m in call.messages if m["role"] == "user") if call.messages else \
            call.prompt.count("user:")
        self.calls.append(call)
        self.order.append((conv, turn))
        await asyncio.sleep(0.001)
        return RequestOutput(True, prompt_len=call.prompt_len, output_len=call.output_len,
                             generated_text=f"reply-{conv}-{turn}")


def test_multiturn_turns_carry_history_and_generated_replies() -> None:
    convs = [Conversation(("A1", "A2", "A3"), (5, 6, 7)), Conversation(("B1", "B2"), (8, 9))]
    client = FakeClient("openai-chat")
    with tqdm(disable=True) as bar:
        outs = asyncio.run(bs._run_conversations(client, convs, math.inf, 0.0, 0, None, bar))
    assert len(outs) == 5
    assert [o.turn for o in outs] == [1, 2, 3, 1, 2]  # each output knows its turn
    by_conv = {c: [t for cc, t in client.order if cc == c] for c in ("A1", "B1")}
    assert by_conv == {"A1": [1, 2, 3], "B1": [1, 2]}  # each conversation in turn order
    assert client.order[:2] == [("A1", 1), ("B1", 1)]  # conversations interleave
    last_a = [c for c in client.calls if c.messages[0]["content"] == "A1"][-1]
    assert last_a.messages == [
        {"role": "user", "content": "A1"},
        {"role": "assistant", "content": "reply-A1-1"},
        {"role": "user", "content": "A2"},
        {"role": "assistant", "content": "reply-A1-2"},
        {"role": "user", "content": "A3"},
    ]
    assert last_a.output_len == 7


def test_multiturn_text_backends_render_the_chat_template() -> None:
    client = FakeClient("radixlm")
    with tqdm(disable=True) as bar:
        asyncio.run(bs._run_conversations(client, [Conversation(("A1", "A2"), (3, 4))],
                                          math.inf, 0.0, 0, WordTokenizer(), bar))
    second = client.calls[1]
    assert second.prompt == "user: A1\nassistant: reply-A1-1\nuser: A2\nassistant:"
    assert second.prompt_len == 7 and second.messages is None


# ----------------------------------------------------------------------------- CLI, plots
def test_cli_rejects_bad_flag_combinations(capsys) -> None:
    for argv, message in (
        (["--backend", "hf-generate-batch", "--model-path", "m", "--request-rate", "2"],
         "runs offline"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        # from an adversarial pass: tracebacks or silent runs before
        (["--request-rate", "0"], "--request-rate values must be > 0"),
        (["--request-rate", "2", "nan"], "--request-rate values must be > 0"),
        (["--random-input-len", "0"], "--random-input-len must be >= 1"),
        (["--random-output-len", "-4"], "--random-output-len must be >= 1"),
        (["--random-range-ratio", "2"], "--random-range-ratio must be in [0, 1]"),
        (["--sharegpt-output-len", "-5"], "--sharegpt-output-len must be >= 1"),
        (["--gsp-num-groups", "0"], "--gsp-num-groups must be >= 1"),
        (["--multiturn-max-turns", "0"], "--multiturn-max-turns must be >= 1"),
        (["--multiturn-think-time", "nan"], "--multiturn-think-time must be a finite number >= 0"),
        (["--dataset-path", "/nonexistent.json"], "--dataset-path /nonexistent.json: no such file"),
    ):
        with pytest.raises(SystemExit) as exc:
            bs.parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_help_shows_each_default_once(capsys) -> None:
    """Every option with a value default shows it once in --help (as launch_server's help);
    a text that states its default keeps its own wording."""
    with pytest.raises(SystemExit):
        bs.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--port PORT server port (default: 30000)", "prompt source (default: sharegpt)",
                  "(default: 1000)", "output tokens (default: 256)", "one run each, same requests (default: inf)"):
        assert shown in text, shown
    assert text.count("(default: inf)") == 1 and "SUPPRESS" not in text and "(default: None)" not in text


def test_plots_from_outputs_and_records(tmp_path: Path, capsys) -> None:
    outs = [RequestOutput(True, 5, 3, ttft=0.1, itl=[0.01, 0.02], latency=0.2)]
    assert bs.plot_run(outs, "run", tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 1000
    assert not bs.plot_run([RequestOutput(True, 5, 3, latency=1.0)], "x", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    records = [{"backend": "radixlm", "dataset_name": "sharegpt", "request_rate": rate,
                "median_ttft_ms": 10 * rate, "p99_ttft_ms": 20 * rate, "median_itl_ms": 5.0,
                "p99_itl_ms": None, "output_throughput": 100 * rate} for rate in (1.0, 2.0, 4.0)]
    records.append({**records[0], "request_rate": None})  # offline: not on the curve
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bs.plot_main([str(path), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert "(3 runs; 1 at request rate inf left out)" in capsys.readouterr().out
    offline = tmp_path / "offline.jsonl"
    offline.write_text(json.dumps(records[-1]) + "\n")
    with pytest.raises(SystemExit, match="no record with a finite request rate among 1"):
        bs.plot_main([str(offline), "--out", str(tmp_path / "none.png")])
    assert not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------- transformers
@pytest.fixture
def tiny_model(tiny_hf_model):
    _, model = tiny_hf_model("llama", bos_token_id=1, eos_token_id=2)
    return model


def _workload() -> list[BenchRequest]:
    return random_requests(6, input_len=20, output_len=8, range_ratio=0.5, vocab_size=256,
                           seed=3)


def test_hf_generate_counts_each_requests_own_length(tiny_model) -> None:
    from radixlm.runtime.bench.hf_baseline import run_generate

    reqs = _workload()
    ids = [list(r.prompt) for r in reqs]
    outs, duration = run_generate(tiny_model, ids, reqs, batch_size=4, ignore_eos=True,
                                  pad_id=0, eos={2}, device="cpu")
    assert [o.output_len for o in outs] == [r.output_len for r in reqs]
    assert [o.prompt_len for o in outs] == [r.prompt_len for r in reqs]
    assert all(o.success and o.ttft is None and o.itl == [] for o in outs)
    # requests of one batch finish together, the second batch after the first
    assert len({o.latency for o in outs[:4]}) == 1 and len({o.latency for o in outs[4:]}) == 1
    assert 0 < outs[0].latency < outs[4].latency <= duration


def test_hf_backend_defaults_to_the_servers_model_and_dtype(tmp_path: Path, capsys) -> None:
    """Without --model-path the baselines load launch_server's default model (the packaged
    GGUF's converted directory) and --dtype auto resolves as the server's (float32 on CPU);
    a bad path is a one-line error, not a traceback."""
    from radixlm.runtime.executor.model_loader import resolve_model_path

    out = tmp_path / "runs.jsonl"
    argv = ["--backend", "hf-generate", "--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "8",
            "--random-output-len", "2", "--random-range-ratio", "1", "--disable-tqdm", "--output-file", str(out)]
    assert bs.main(argv) == 0
    rec = json.loads(out.read_text())
    assert rec["model_path"] == resolve_model_path(None) and rec["dtype"] == "float32"
    assert rec["completed"] == 2 and rec["total_output_tokens"] == 4
    with pytest.raises(SystemExit, match="--model-path: .*neither a model directory"):
        bs.main([*argv[:2], "--model-path", str(tmp_path / "missing.bin")])


def test_hf_generate_batch_continuous_batching(tiny_model) -> None:
    from radixlm.runtime.bench.hf_baseline import run_generate_batch

    reqs = _workload()
    ids = [list(r.prompt) for r in reqs]
    outs, duration = run_generate_batch(tiny_model, ids, reqs, ignore_eos=True, pad_id=0,
                                        eos={2}, device="cpu",
                                        cb_config={"num_blocks": 16, "max_batch_tokens": 128})
    assert [o.error for o in outs] == [""] * 6
    assert [o.output_len for o in outs] == [r.output_len for r in reqs]
    assert all(o.success and o.ttft is None for o in outs)
    assert all(0 < o.latency <= duration for o in outs)
    m = compute_metrics(outs, duration, len(outs))
    assert m["completed"] == 6 and m["mean_ttft_ms"] is None
    assert m["total_output_tokens"] == sum(r.output_len for r in reqs)


def test_sample_kv_keeps_waste_only_while_pages_are_in_use() -> None:
    scrapes = iter([
        {"radixlm:kv_cache_usage": 0.0, "radixlm:kv_cache_waste_ratio": 0.0},  # idle: no waste sample
        None,  # a failed scrape
        {"radixlm:kv_cache_usage": 0.5, "radixlm:kv_cache_waste_ratio": 0.02, "radixlm:num_running_reqs": 3.0},
        {"radixlm:kv_cache_usage": 0.25, "radixlm:kv_cache_waste_ratio": 0.04, "radixlm:num_running_reqs": 2.0},
    ])
    stats = bs.ServerStats(client=None, base_url="http://x")

    async def scrape():
        try:
            return next(scrapes)
        except StopIteration:
            raise asyncio.CancelledError from None

    stats.scrape = scrape

    async def run():
        with contextlib.suppress(asyncio.CancelledError):
            await stats.sample_kv(period_s=0)

    asyncio.run(run())
    assert stats.kv_samples == [0.0, 0.5, 0.25]
    assert stats.waste_samples == [0.02, 0.04]
    assert stats.running_samples == [3.0, 2.0]
    summary = stats.summary(None)
    assert summary["kv_waste_mean"] == pytest.approx(0.03) and summary["kv_waste_max"] == 0.04


# ----------------------------------------------------------------------------- any OpenAI server
class FakeOpenAIServer:
    """An OpenAI-compatible server in a thread (uvicorn on a free port), vLLM-like: /v1/models
    (one model whose ``root`` is ``state["root"]``), streamed /v1/completions and
    /v1/chat/completions with usage, /version, vLLM v1 counters at /metrics (two engines).
    Each completion adds its prompt tokens to the prefix-cache queries and 3/4 of them to
    the hits (counters start at 1000 / 100, so a rate over the server's life is not 0.75);
    a chat prompt counts 7 tokens. ``state`` switches routes on and off (404 when off)."""

    def __init__(self, root: str) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        self.state = {"root": root, "version": "0.26.0", "metrics": True, "get_server_info": None,
                      "server_info": None, "reset_prefix_cache": False}
        self.counters = {"queries": 1000.0, "hits": 100.0}
        self.running, self.bodies, self.posts = 0, [], []
        app, state = FastAPI(), self.state
        missing = JSONResponse({"detail": "Not Found"}, status_code=404)

        async def stream(chat: bool, prompt_tokens: int, n: int):
            self.running += 1
            try:
                for i in range(n):
                    await asyncio.sleep(0.01)  # the run outlasts the first /metrics sample
                    choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                         "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.running -= 1

        def complete(body: dict, chat: bool):
            self.bodies.append(body)
            prompt = body.get("prompt")
            tokens = 7 if chat else len(prompt) if isinstance(prompt, list) else len(prompt.split())
            self.counters["queries"] += tokens
            self.counters["hits"] += tokens * 3 // 4 if isinstance(prompt, list) else 0
            return StreamingResponse(stream(chat, tokens, body["max_tokens"]), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(body: dict):
            return complete(body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: dict):
            return complete(body, chat=True)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model", "root": state["root"]}]}

        @app.get("/version")
        async def version():
            return {"version": state["version"]} if state["version"] else missing

        @app.get("/get_server_info")
        async def get_server_info():
            return state["get_server_info"] if state["get_server_info"] is not None else missing

        @app.get("/server_info")
        async def server_info():
            return state["server_info"] if state["server_info"] is not None else missing

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            self.posts.append("/reset_prefix_cache")
            return PlainTextResponse("") if state["reset_prefix_cache"] else missing

        @app.get("/metrics")
        async def metrics():
            if not state["metrics"]:
                return missing
            c, labels = self.counters, 'engine="{}",model_name="fake-model"'
            lines = ["# TYPE vllm:prefix_cache_queries counter", "# TYPE vllm:prefix_cache_hits counter",
                     "# TYPE vllm:kv_cache_usage_perc gauge", "# TYPE vllm:num_requests_running gauge"]
            for engine, share, kv in ((0, 0.25, 0.2), (1, 0.75, 0.6)):  # two engines (data parallel)
                lab = labels.format(engine)
                lines += [f"vllm:prefix_cache_queries_total{{{lab}}} {c['queries'] * share}",
                          f"vllm:prefix_cache_hits_total{{{lab}}} {c['hits'] * share}",
                          f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
                          f"vllm:num_requests_running{{{lab}}} {self.running if engine == 0 else 0}"]
            return PlainTextResponse("\n".join(lines) + "\n")

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_openai_server(smollm2_dir):
    srv = FakeOpenAIServer(smollm2_dir)
    yield srv
    srv.close()


@pytest.fixture
def fake_server(fake_openai_server):
    """The module's fake server, its routes back to vLLM's defaults after the test."""
    saved = dict(fake_openai_server.state)
    fake_openai_server.bodies.clear()
    fake_openai_server.posts.clear()
    yield fake_openai_server
    fake_openai_server.state.update(saved)


def _bench(srv: FakeOpenAIServer, out: Path, *flags: str) -> list[dict]:
    assert bs.main(["--base-url", srv.url, "--disable-tqdm", "--output-file", str(out), "--dataset-name", "random",
                    "--random-range-ratio", "1.0", *flags]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_openai_backend_against_a_vllm_like_server(fake_server, smollm2_dir, tmp_path: Path) -> None:
    """No /get_server_info, /server_info nor /generate: a plain OpenAI server, named vLLM by
    its /version; the model and tokenizer come from /v1/models; the hit rate from vLLM's
    prefix-cache counters (their change over the run, summed over engines)."""
    [rec] = _bench(fake_server, tmp_path / "runs.jsonl", "--backend", "openai", "--num-prompts", "6",
                   "--random-input-len", "32", "--random-output-len", "5")
    assert (rec["completed"], rec["failed"]) == (6, 0)
    assert (rec["total_input_tokens"], rec["total_output_tokens"]) == (6 * 32, 6 * 5)
    assert rec["server"] == {"name": "vllm", "version": "0.26.0"}
    assert rec["base_url"] == fake_server.url and rec["model_path"] == smollm2_dir
    assert rec["prefix_cache_hit_rate"] == pytest.approx(0.75)  # 24 of 32 per prompt
    assert rec["kv_usage_mean"] == pytest.approx(0.4) and rec["kv_usage_max"] == pytest.approx(0.4)  # mean of engines
    assert rec["running_reqs_max"] is not None and 0 <= rec["running_reqs_max"] <= 6
    assert rec["kv_waste_mean"] is None and rec["kv_waste_max"] is None  # vLLM has no such metric
    assert rec["cache_flushed"] is None and rec["mean_ttft_ms"] > 0 and rec["mean_itl_ms"] > 0
    warm, *runs = fake_server.bodies
    assert warm["prompt"] == "Hello" and warm["max_tokens"] == 4
    assert {b["model"] for b in fake_server.bodies} == {"fake-model"}
    assert all(b["ignore_eos"] is True and b["stream"] is True and b["stream_options"] == {"include_usage": True}
               and len(b["prompt"]) == 32 for b in runs)


def test_openai_chat_without_metrics_and_flush_cache_unsupported(fake_server, tmp_path: Path, capsys) -> None:
    """Chat: the counts are the server's usage (7 prompt tokens each); no /metrics: every server
    number null; --flush-cache with both routes 404: one warning for two runs, false in both."""
    fake_server.state["metrics"] = False
    recs = _bench(fake_server, tmp_path / "runs.jsonl", "--backend", "openai-chat", "--num-prompts", "3",
                  "--random-input-len", "8", "--random-output-len", "4", "--request-rate", "1000", "inf",
                  "--flush-cache")
    assert [r["request_rate"] for r in recs] == [1000, None]
    for rec in recs:
        assert (rec["completed"], rec["total_input_tokens"], rec["total_output_tokens"]) == (3, 21, 12)
        assert rec["cache_flushed"] is False and rec["server"] == {"name": "vllm", "version": "0.26.0"}
        for key in ("prefix_cache_hit_rate", "kv_usage_mean", "kv_usage_max", "kv_waste_mean",
                    "kv_waste_max", "running_reqs_mean", "running_reqs_max"):
            assert rec[key] is None, key
    assert fake_server.posts == ["/reset_prefix_cache"] * 2  # tried after /flush_cache's 404, each run
    out = capsys.readouterr().out
    assert out.count("warning: --flush-cache") == 1
    assert "POST /flush_cache: HTTP 404, POST /reset_prefix_cache: HTTP 404" in out
    assert all(b["messages"][0]["role"] == "user" for b in fake_server.bodies)
    # vLLM's dev-mode route works: flushed
    fake_server.state["reset_prefix_cache"] = True
    [*_, rec] = _bench(fake_server, tmp_path / "runs.jsonl", "--backend", "openai", "--num-prompts", "1",
                       "--random-input-len", "4", "--random-output-len", "2", "--flush-cache")
    assert rec["cache_flushed"] is True and "warning" not in capsys.readouterr().out


def test_extra_request_body_reaches_every_request(fake_server, tmp_path: Path, capsys) -> None:
    """--extra-request-body adds its keys to each body (warm-up included) and to the record;
    --disable-ignore-eos leaves the ignore_eos field out (a strict server refuses unknown
    fields); the CLI refuses what is not a JSON object."""
    extra = {"min_tokens": 3, "repeat_penalty": 1.0}
    [rec] = _bench(fake_server, tmp_path / "runs.jsonl", "--backend", "openai-chat", "--num-prompts", "2",
                   "--random-input-len", "4", "--random-output-len", "3", "--disable-ignore-eos",
                   "--extra-request-body", json.dumps(extra))
    assert rec["completed"] == 2 and rec["extra_request_body"] == extra and rec["ignore_eos"] is False
    assert len(fake_server.bodies) == 3
    assert all(b["min_tokens"] == 3 and b["repeat_penalty"] == 1.0 and b["max_tokens"] in (3, 4)
               and "ignore_eos" not in b for b in fake_server.bodies)
    for bad, message in (("[1]", "must be a JSON object"), ("{x", "not JSON")):
        with pytest.raises(SystemExit):
            bs.parse_args(["--extra-request-body", bad])
        assert message in capsys.readouterr().err


def test_multiturn_details_carry_the_turn(fake_server, tmp_path: Path) -> None:
    msgs = [{"from": who, "value": f"{who} {i}"} for i in range(3) for who in ("human", "gpt")]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{k}", "conversations": msgs[: 2 * (k + 2)]}) + "\n"
                            for k in range(2)))  # 2 and 3 turns
    out = tmp_path / "runs.jsonl"
    assert bs.main(["--base-url", fake_server.url, "--disable-tqdm", "--output-file", str(out),
                    "--backend", "openai-chat", "--dataset-name", "sharegpt-multiturn", "--dataset-path",
                    str(data), "--num-prompts", "2", "--multiturn-output-len", "2",
                    "--multiturn-think-time", "0", "--output-details"]) == 0
    [rec] = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(d["turn"] for d in rec["details"]) == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("routes, expected", [
    ({"get_server_info": {"name": "radixlm", "version": "0.1.0", "tokenizer_path": "T",
                          "served_model_name": "m", "model_path": "M"}}, ("radixlm", "0.1.0", "m", "T", "M")),
    ({"server_info": {"version": "0.5.4", "internal_states": [{}], "tp_size": 1, "tokenizer_path": "T",
                      "served_model_name": "s", "model_path": "M"}}, ("sglang", "0.5.4", "s", "T", "M")),
    ({"server_info": {"vllm_config": "model=/m ..."}}, ("vllm", "0.26.0", "fake-model", "ROOT", "ROOT")),
    ({"version": None}, ("unknown", None, "fake-model", "ROOT", "ROOT")),
])
def test_discover_server_names_the_server(fake_server, smollm2_dir, routes, expected) -> None:
    fake_server.state.update(routes)
    srv = bs.discover_server(fake_server.url)
    want = tuple(smollm2_dir if v == "ROOT" else v for v in expected)
    assert (srv.name, srv.version, srv.model, srv.tokenizer, srv.model_path) == want
    flagged = bs.discover_server(fake_server.url, model="x", tokenizer="tok-dir")
    assert (flagged.model, flagged.tokenizer) == ("x", "tok-dir")


def test_discover_server_exits_clearly(fake_server, smollm2_dir) -> None:
    fake_server.state["root"] = "org/model-on-the-hub"  # not a local directory: no tokenizer
    with pytest.raises(SystemExit, match=r"cannot tell the tokenizer of the vllm server .*'org/model-on-the-hub'"
                                         r".*pass --tokenizer"):
        bs.discover_server(fake_server.url)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=f"cannot reach the server at http://127.0.0.1:{port}"):
        bs.discover_server(f"http://127.0.0.1:{port}")
    # the native backend needs /generate: its warm-up fails with the HTTP error and a hint
    with pytest.raises(SystemExit, match=r"warm-up request failed: RuntimeError: HTTP 404.*--backend openai"):
        bs.main(["--base-url", fake_server.url, "--backend", "radixlm", "--tokenizer", smollm2_dir,
                 "--dataset-name", "random", "--num-prompts", "1", "--random-input-len", "4",
                 "--random-output-len", "2", "--disable-tqdm"])


def test_server_stats_read_vllm_names_and_average_per_engine_fractions() -> None:
    text = ('vllm:prefix_cache_queries_total{engine="0"} 100.0\nvllm:prefix_cache_queries_total{engine="1"} 300.0\n'
            'vllm:prefix_cache_hits_total{engine="0"} 10.0\nvllm:prefix_cache_hits_total{engine="1"} 30.0\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:kv_cache_usage_perc{engine="1"} 0.3\n')
    before = bs.parse_prometheus(text, bs._FRACTIONS)
    assert before["vllm:prefix_cache_queries_total"] == 400.0 and before["vllm:kv_cache_usage_perc"] == pytest.approx(0.2)
    stats = bs.ServerStats(client=None, base_url="http://x")
    stats.before = before
    after = {**before, "vllm:prefix_cache_queries_total": 600.0, "vllm:prefix_cache_hits_total": 90.0}
    summary = stats.summary(after)
    assert stats.names is bs.METRIC_NAMES["vllm"]
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.25)  # 50 hits of 200 queries
    other = bs.ServerStats(client=None, base_url="http://x")  # names of neither server: nulls
    other.before = {"sglang:prompt_tokens_total": 1.0}
    assert other.summary({"sglang:prompt_tokens_total": 5.0})["prefix_cache_hit_rate"] is None and other.names == {}
