"""The serving benchmark on CPU without a server: workloads, arrivals, metrics, multi-turn
replay against a fake client, plots, and the transformers baselines on a tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
from pathlib import Path

import pytest
from tqdm import tqdm

from radixlm.runtime.bench import serving as bs
from radixlm.runtime.bench.datasets import (
    BenchRequest,
    Conversation,
    RequestOutput,
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
    client = FakeClient("radixlm-oai-chat")
    with tqdm(disable=True) as bar:
        outs = asyncio.run(bs._run_conversations(client, convs, math.inf, 0.0, 0, None, bar))
    assert len(outs) == 5
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
