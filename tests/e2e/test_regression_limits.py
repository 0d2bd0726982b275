"""Limits and failures on a real server: regression cases C06 and C07, plus the death of
the scheduler child process.

- C06 client disconnect: a request whose client goes away (during prefill, mid-decode,
  or a non-streaming client timing out) is aborted; its pages are freed, its shared
  prefix stays cached and unlocked; concurrent requests sharing the prefix are
  unaffected; the scheduler never exits.
- C07 prompt vs KV pool / context: a prompt larger than the KV pool is a fast HTTP 400
  (documented policy: the server starts with a pool smaller than one context and refuses
  such prompts per request); at the context limit, prompt = context - 1 works, prompt =
  context is 400, and ``max_tokens`` past the context is clamped (``finish_reason``
  length, documented policy); a pool too small for the running requests preempts
  and finishes every request, none is lost.
- Scheduler death: in-flight requests get an error instead of hanging, /health turns
  non-200 and the launcher exits with a non-zero status, leaving no process behind.
- SIGTERM: in-flight requests (streamed and not) are finished, then the launcher exits
  with status 0, leaving no process behind.
- A very long generation (max_tokens 10000, ignore_eos) is cut at the context limit with
  ``finish_reason`` length on every route; a generation that outgrows the KV pool says so
  (native ``finish_reason.message``).

Timing: the model runs on a shared, slow 2-core CPU machine (other engineers run tests on
it at the same time), so bounds are generous ("within 20 s") rather than the case's
"within one scheduler step (<= 1 s)"; the per-case numbers are printed (``-s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

MODEL = "default"
PAGE = 16
# Bound for "the request is gone / the server reacted" on the shared 2-core machine: one
# scheduler step with a 512-token prefill chunk can take well over 1 s there.
SETTLE_S = 20.0


# --------------------------------------------------------------------------- helpers
def _metrics(srv: Any) -> dict[str, float]:
    """Prometheus samples by bare metric name (labels dropped, values summed)."""
    text = httpx.get(f"{srv.url}/metrics", timeout=60).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _children(pid: int) -> list[int]:
    pids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        pids += [int(p) for p in children.read_text().split()]
    return pids


def _scheduler_pid(srv: Any) -> int:
    """The scheduler: the launcher's multiprocessing 'spawn' child (not psutil: read
    /proc/<pid>/task/*/children; a resource-tracker child, if any, is skipped)."""
    pids = _children(srv.proc.pid)
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no scheduler child among {pids}")


def _wait_baseline(srv: Any, timeout: float = SETTLE_S) -> tuple[float, dict]:
    """Wait until no request is live or queued (scheduler report and /metrics gauges,
    which refresh every ~0.5 s) and no radix lock is held. Returns (seconds, report)."""
    start = time.monotonic()
    while True:
        report = srv.invariants()
        if report["num_live"] == 0 and report["locked_pages"] == 0:
            m = _metrics(srv)
            if m["radixlm:num_running_reqs"] == 0 and m["radixlm:num_queue_reqs"] == 0:
                return time.monotonic() - start, report
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not back to baseline after {timeout} s: {report} {_metrics(srv)}")
        time.sleep(0.1)


def _group_processes(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` (the launcher runs in its
    own session, so its group is the launcher, the scheduler and multiprocessing's
    resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # the process went away
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _assert_no_process_left(pgid: int) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (left := _group_processes(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


def _ids(n: int, offset: int = 0) -> list[int]:
    """n valid, non-special token ids (a deterministic pseudo-random text)."""
    return [1000 + (i * 7919 + offset) % 40000 for i in range(n)]


# --------------------------------------------------------------------------- C06
_WORDS = ["amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
# ~300-token shared prefix (page-aligned reuse of most of it) ...
C06_PREFIX = "Warehouse notes. " + " ".join(
    f"Shelf {i} holds the {_WORDS[i % 10]} box number {i * 13 % 97}." for i in range(24))
C06_QUESTIONS = ["Which box is on shelf 3?", "Which box is on shelf 7?", "What does shelf 11 hold?"]
# C06 repeats the disconnect 20 times in the full suite, not the case's 200: each
# repetition prefills ~625 fresh tokens on a shared 2-core CPU (seconds each); the variants
# and disconnect points are drawn at random (fixed seed, printed) so the 20 cover all of
# them. The fast tier's 4 rounds take each variant once.
C06_ROUNDS = [4, pytest.param(20, marks=pytest.mark.slow)]
C06_SEED = 606


def _c06_tail(rng: random.Random) -> str:
    """~625 fresh tokens: the prefill takes two 512-token chunks (a disconnect can land
    inside it) and the prompt totals ~1000 tokens."""
    return " ".join(str(rng.randint(1000, 9999)) for _ in range(125))


def _c06_long_body(rng: random.Random, stream: bool) -> dict:
    content = f"{C06_PREFIX}\n\nNumbers: {_c06_tail(rng)}\n\nRepeat the numbers."
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def _c06_normal(c: httpx.Client, q: str) -> dict:
    r = c.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": f"{C06_PREFIX}\n\n{q}"}],
        "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"]}


def _disconnect(srv: Any, variant: str, rng: random.Random) -> str:
    """Send one long request and drop the connection per ``variant``; returns what the
    client saw before dropping (for the log)."""
    if variant == "nonstream-timeout":
        # The client gives up after 0.3-4 s: during prefill or early decode.
        read = rng.uniform(0.3, 4.0)
        with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=read)) as c:
            try:
                r = c.post("/v1/chat/completions", json=_c06_long_body(rng, stream=False))
            except httpx.ReadTimeout:
                return f"timeout after {read:.1f}s"
            raise AssertionError(f"a 2000-token request finished within {read:.1f} s: {r.status_code}")
    if variant == "native-stream-first-byte":
        # /generate streams nothing before the first token: a short read timeout drops
        # the connection before the first byte of the body (during prefill), unless
        # the first event comes first (then the connection is dropped on it).
        read = rng.uniform(0.2, 2.0)
        body = _c06_long_body(rng, stream=True)
        native = {"text": body["messages"][0]["content"], "stream": True,
                  "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
        with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=read)) as c:
            try:
                with c.stream("POST", "/generate", json=native) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            return "first event"
            except httpx.ReadTimeout:
                return f"no byte within {read:.1f}s"
        raise AssertionError("stream ended without an event")
    # Chat streams: the role chunk comes at once, content after the prefill.
    if variant == "chat-prefill":
        read, wanted = rng.uniform(0.2, 1.5), 1  # drop while waiting for the first content
    else:  # "chat-decode": drop after 1-4 content chunks
        read, wanted = 60.0, rng.randint(1, 4)
    seen = 0
    with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=read)) as c:
        try:
            with c.stream("POST", "/v1/chat/completions", json=_c06_long_body(rng, stream=True)) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            seen += 1
                            if seen >= wanted:
                                return f"{seen} content chunks"
        except httpx.ReadTimeout:
            return f"{seen} content chunks, then timeout {read:.1f}s"
    raise AssertionError("stream ended before the disconnect point")


@pytest.mark.parametrize("rounds", C06_ROUNDS)
def test_c06_client_disconnect_frees_everything(server, idle_invariants, rounds):
    rng = random.Random(C06_SEED)
    sched = _scheduler_pid(server)
    _wait_baseline(server)
    with server.client() as c:
        _c06_normal(c, C06_QUESTIONS[0])  # warm the shared prefix
        refs = {q: _c06_normal(c, q) for q in C06_QUESTIONS}
    print(f"\nC06 seed {C06_SEED}; reference prompt_tokens "
          f"{ {q[-12:]: r['usage']['prompt_tokens'] for q, r in refs.items()} }")

    variants = ["chat-prefill", "chat-decode", "nonstream-timeout", "native-stream-first-byte"]
    log = []
    for i in range(rounds):
        variant = variants[i % len(variants)] if i < len(variants) else rng.choice(variants)
        q = rng.choice(C06_QUESTIONS)
        concurrent = rng.random() < 0.5  # the normal request runs while the long one is live
        delay = rng.uniform(0.0, 1.5)
        with cf.ThreadPoolExecutor(1) as ex, server.client() as c:
            if concurrent:  # starts 0-1.5 s after the long request, shares its prefix
                normal = ex.submit(lambda c=c, q=q, d=delay: (time.sleep(d), _c06_normal(c, q))[1])
            saw = _disconnect(server, variant, rng)
            t_drop = time.monotonic()
            if not concurrent:  # the abort alone: back to baseline within SETTLE_S
                _, report = _wait_baseline(server, timeout=SETTLE_S)
                abort_s = time.monotonic() - t_drop
                normal = ex.submit(_c06_normal, c, q)
            got = normal.result()
        ref = refs[q]
        assert got["text"] == ref["text"], (i, variant, got, ref)
        usage = got["usage"]
        assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"], (i, variant, usage)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # The shared prefix stayed cached (and usable) through the aborts.
        assert 0 < cached <= usage["prompt_tokens"] - 1 and cached % PAGE == 0, (i, variant, usage)
        if concurrent:  # the normal request took part of the time: SETTLE_S from its end
            _, report = _wait_baseline(server, timeout=SETTLE_S)
            abort_s = time.monotonic() - t_drop
        else:
            _, report = _wait_baseline(server, timeout=SETTLE_S)
        assert report["ok"] and not report["violations"], report
        assert server.proc.poll() is None, "server exited"
        log.append(f"{i:2d} {variant:25s} {saw:32s} concurrent={concurrent!s:5s} baseline after {abort_s:4.1f}s")
    print("\n".join(log))
    assert _scheduler_pid(server) == sched, "the scheduler process was replaced"
    idle_invariants(server)


# --------------------------------------------------------------------------- C07
def _timed_post(c: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, float]:
    t = time.monotonic()
    r = c.post(path, json=body)
    return r, time.monotonic() - t


def _assert_400(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err)


@pytest.mark.slow
def test_c07_prompt_larger_than_kv_pool_is_fast_400(server_factory, idle_invariants):
    """Context 8192 with a KV pool of 4096 tokens (documented policy: the server starts;
    prompts that cannot fit in the pool are refused per request with 400)."""
    with server_factory(max_total_tokens=4096) as srv, srv.client() as c:
        info = c.get("/get_model_info").json()
        assert info["context_length"] == 8192 and info["max_total_tokens"] == 4096, info
        sched = _scheduler_pid(srv)
        with cf.ThreadPoolExecutor(1) as ex:
            other = ex.submit(lambda: c.post("/generate", json={
                "text": "Once upon a time", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}))
            big = _ids(6000)
            cases = [
                ("/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 16}),
                ("/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 16, "stream": True}),
                ("/generate", {"input_ids": big, "sampling_params": {"max_new_tokens": 16}}),
                ("/v1/chat/completions", {"model": MODEL, "max_tokens": 16, "messages": [
                    {"role": "user", "content": " apple" * 6000}]}),
                # Boundary: 4096 prompt tokens + 1 generated token need 4097 slots > 4096.
                ("/v1/completions", {"model": MODEL, "prompt": _ids(4096), "max_tokens": 1}),
            ]
            for path, body in cases:
                r, took = _timed_post(c, path, body)
                _assert_400(r, "KV cache capacity")
                # "Fast": no prefill is attempted. 10 s is generous for the shared CPU
                # (the case asks <= 1 s; a 6000-token chat prompt is tokenized first).
                assert took < 10, f"{path}: 400 after {took:.1f} s"
            r = other.result()
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 24, r.text

        # Still serving afterwards. (A prompt that fits but whose generation outgrows the
        # pool is covered by test_c07_generation_outgrowing_a_tiny_pool: prefilling ~4090
        # tokens here would cost minutes of the shared CPU.)
        r = c.post("/generate", json={"input_ids": _ids(40, 2), "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        assert srv.proc.poll() is None and _scheduler_pid(srv) == sched
        idle_invariants(srv)


@pytest.mark.slow
def test_c07_prompt_at_context_limit(server_factory, idle_invariants):
    """Substitution for CPU time: context_length=1024 instead of the model's 8192 (the
    limits are the same code path; prefilling 8191 tokens on the shared CPU takes minutes).
    Documented policy for prompt + max_tokens > context: clamp to the context."""
    with server_factory(context_length=1024, max_total_tokens=2048) as srv, srv.client() as c:
        ctx = c.get("/get_model_info").json()["context_length"]
        assert ctx == 1024
        full = _ids(ctx + 1)

        def comp(n: int, max_tokens: int, **kw) -> httpx.Response:
            return c.post("/v1/completions", json={"model": MODEL, "prompt": full[:n], "max_tokens": max_tokens,
                                                   "ignore_eos": True, "temperature": 0, **kw})

        r = comp(ctx - 1, 1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["prompt_tokens"] == ctx - 1
        assert r.json()["usage"]["completion_tokens"] == 1
        for n in (ctx, ctx + 1):
            _assert_400(comp(n, 1), "context length")
            _assert_400(c.post("/generate", json={"input_ids": full[:n], "stream": True}), "context")
        _assert_400(c.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": " apple" * ctx}]}), "context")

        # max_tokens past the context: clamped, finish "length" after the room left.
        for n, room in ((ctx - 1, 1), (ctx - 2, 2)):
            r = comp(n, 100)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length", r.json()
            assert r.json()["usage"]["completion_tokens"] == room, r.json()["usage"]
        r = c.post("/generate", json={"input_ids": full[: ctx - 1],
                                      "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
        with c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": full[: ctx - 1], "max_tokens": 100, "ignore_eos": True,
                "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
        assert sum(bool(e["choices"][0]["text"]) for e in events) <= 1
        idle_invariants(srv)


@pytest.mark.parametrize(("policy", "mode"), [
    ("lru", "recompute"),
    pytest.param("longest", "swap", marks=pytest.mark.slow),
    pytest.param("importance", "auto", marks=pytest.mark.slow),
])
def test_c07_generation_outgrowing_a_tiny_pool(server_factory, idle_invariants, policy, mode):
    """A 128-token pool (8 pages; "e.g. 512" shrunk for CPU time) with four concurrent
    ignore_eos requests: three need 50 tokens (4 pages) each, so they fit alone but not
    together (preemption); one would need 264 tokens, more than the whole pool (finished
    with "length" when the pool is full). Every request completes; none is lost; greedy
    output equals the unpreempted reference, under each preemption policy and mode (auto
    swaps on the CPU: copying KV is far cheaper than recomputing it there). The decode
    reserve is off so that admission lets them all in and preemption must happen."""
    flags = dict(max_total_tokens=128, preemption_policy=policy, preemption_mode=mode,
                 decode_reserve_ratio=0.0, decode_reserve_min_ratio=0.0)
    with server_factory(**flags) as srv, srv.client() as c:
        info = c.get("/get_model_info").json()
        assert info["max_total_tokens"] == 128
        tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])

        def gen(ids: list[int], max_new: int) -> dict:
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}})
            assert r.status_code == 200, r.text
            return r.json()

        # Natural-text prompts (confident greedy choices: no near-ties that recompute
        # numerics could flip), exactly 20 tokens each.
        a = tok.encode("The history of the printing press begins in the fifteenth century, when "
                       "Johannes Gutenberg of Mainz developed movable type")[:20]
        b = tok.encode("Photosynthesis is the process by which green plants and some other "
                       "organisms use sunlight to synthesize foods from carbon dioxide and water")[:20]
        assert len(a) == len(b) == 20
        ref_a = gen(a, 30)  # alone: no preemption
        assert ref_a["meta_info"]["completion_tokens"] == 30
        jobs = [(a, 30), (a, 30), (b, 30), (_ids(64, 5), 200)]
        with cf.ThreadPoolExecutor(len(jobs)) as ex:
            outs = list(ex.map(lambda job: gen(*job), jobs))
        for (ids, max_new), out in zip(jobs, outs, strict=True):
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "length", meta
            assert meta["prompt_tokens"] == len(ids)
            assert meta["completion_tokens"] == len(out["output_ids"])
            if len(ids) + max_new <= 128:
                assert meta["completion_tokens"] == max_new, meta
                assert "message" not in meta["finish_reason"], meta  # the limit, not the pool
            else:  # more than the whole pool: stopped when it is full, and says so
                assert 1 <= meta["completion_tokens"] <= 128 - len(ids) + 1, meta
                assert meta["finish_reason"]["message"] == "KV cache pool is full", meta
        # Greedy output does not depend on preemption / recompute.
        assert outs[0]["output_ids"] == ref_a["output_ids"]
        assert outs[1]["output_ids"] == ref_a["output_ids"]
        deadline = time.monotonic() + 5  # scheduler stats reach /metrics every ~0.5 s
        while _metrics(srv)["radixlm:num_preemptions_total"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        metrics = _metrics(srv)
        preemptions = metrics["radixlm:num_preemptions_total"]
        swapped = metrics["radixlm:num_swapped_out_total"]
        print(f"\nC07 tiny pool ({policy}, {mode}): preemptions {preemptions}, swapped {swapped}, "
              f"recomputed tokens {metrics['radixlm:recomputed_tokens_total']}, completions "
              f"{[o['meta_info']['completion_tokens'] for o in outs]}")
        assert preemptions > 0, "the pool was never short: the test did not exercise preemption"
        assert swapped == (0 if mode == "recompute" else preemptions)
        idle_invariants(srv)


# --------------------------------------------------------------------------- scheduler death
def test_scheduler_death_fails_requests_and_exits(server_factory):
    with server_factory(max_total_tokens=4096) as srv:
        sched = _scheduler_pid(srv)
        first_content = threading.Event()
        results: dict[str, Any] = {}

        def streaming() -> None:
            events = []
            try:
                with httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60)) as c, c.stream(
                        "POST", "/v1/chat/completions", json={
                            "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                            "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if '"content":"' in line and '"content":""' not in line:
                                first_content.set()
                results["stream"] = ("ended", events)
            except httpx.HTTPError as exc:  # the connection ended abruptly: also fine
                results["stream"] = (f"error {exc!r}", events)
            finally:
                results["stream_end"] = time.monotonic()
                first_content.set()

        def non_streaming() -> None:
            try:
                r = httpx.post(f"{srv.url}/generate", timeout=60, json={
                    "text": "Write a very long poem.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
                results["plain"] = (r.status_code, r.text)
            except httpx.HTTPError as exc:
                results["plain"] = (None, repr(exc))
            results["plain_end"] = time.monotonic()

        threads = [threading.Thread(target=streaming), threading.Thread(target=non_streaming)]
        for t in threads:
            t.start()
        assert first_content.wait(120), "no content streamed"
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(sched, signal.SIGKILL)
        for t in threads:
            t.join(60)  # httpx's 60 s read timeout would fire if a request hung
            assert not t.is_alive()

        status, events = results["stream"]
        assert results["stream_end"] - t_kill < SETTLE_S, f"stream ended {results['stream_end'] - t_kill:.1f}s after the kill"
        if status == "ended":  # a clean end: an error event, then [DONE] (as vLLM and SGLang end a failed stream)
            assert len(events) >= 2 and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
            last = json.loads(events[-2])
            assert "error" in last and last["error"]["code"] == 503, last
            assert not any('"finish_reason":"' in e for e in events), "a failed stream reported a normal finish"
        code, text = results["plain"]
        assert results["plain_end"] - t_kill < SETTLE_S
        assert code is None or (code == 503 and "scheduler" in json.loads(text)["error"]["message"]), (code, text)

        # /health: non-200 or the connection is refused, then the launcher exits non-zero.
        deadline = t_kill + SETTLE_S
        healthy_after = None
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{srv.url}/health", timeout=5).status_code != 200:
                    break
                healthy_after = time.monotonic() - t_kill
            except httpx.HTTPError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"/health still 200 {healthy_after:.1f} s after the scheduler died")
        try:
            exit_code = srv.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {SETTLE_S} s after the scheduler died:\n{srv.log()[-2000:]}")
        assert exit_code != 0, exit_code
        _assert_no_process_left(srv.proc.pid)
        print(f"\nscheduler killed; stream {status[:40]}, plain {code}, launcher exit {exit_code} "
              f"after {time.monotonic() - t_kill:.1f}s")


# --------------------------------------------------------------------------- SIGTERM
DRAIN_TOKENS = 64  # enough to be mid-generation at the signal; well inside uvicorn's 30 s drain


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(server_factory):
    with server_factory(max_total_tokens=2048) as srv:
        first_content = threading.Event()
        results: dict[str, Any] = {}

        def streaming() -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                    "max_tokens": DRAIN_TOKENS, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if '"content":"' in line and '"content":""' not in line:
                            first_content.set()
                results["stream"] = (r.status_code, events)

        def non_streaming() -> None:
            r = httpx.post(f"{srv.url}/generate", timeout=120, json={
                "text": "Write a long poem.", "sampling_params": {"max_new_tokens": DRAIN_TOKENS, "ignore_eos": True}})
            results["plain"] = (r.status_code, r.json())

        threads = [threading.Thread(target=streaming), threading.Thread(target=non_streaming)]
        for t in threads:
            t.start()
        assert first_content.wait(120), "no content streamed"
        deadline = time.monotonic() + SETTLE_S
        while (live := srv.invariants()["num_live"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live == 2, "both requests must be in flight at the signal"
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        exit_code = srv.proc.wait(60)

        status, events = results["stream"]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS, chunks[-1]
        status, body = results["plain"]
        assert status == 200, body
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": DRAIN_TOKENS}, body["meta_info"]
        assert exit_code == 0, srv.log()[-2000:]
        _assert_no_process_left(srv.proc.pid)
        assert "Traceback" not in srv.log(), srv.log()[-3000:]


# --------------------------------------------------------------------------- context limit
@pytest.mark.slow
def test_very_long_generation_is_cut_at_the_context_limit(server_factory, idle_invariants):
    """max_tokens 10000 with ignore_eos (none for chat: the default is the context) on a
    128-token context (the model's 8192 would cost minutes of the shared CPU; the clamp and
    the stop check are the same code for any length): every route finishes with length
    after exactly context - prompt tokens. The pool (512 tokens) holds all three, so it is
    the context, not the pool, that cuts them (no "message")."""
    ctx = 128
    with server_factory(context_length=ctx, max_total_tokens=512) as srv, srv.client() as c:
        assert c.get("/get_model_info").json()["context_length"] == ctx
        prompt = "Write a very long story about a lighthouse keeper and the sea."

        def completion() -> tuple[int, str, int]:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10000,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            return body["usage"]["prompt_tokens"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]

        def chat_stream() -> tuple[int, str, int]:
            with c.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompt}], "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            finish = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
            usage = events[-1]["usage"]
            return usage["prompt_tokens"], finish[-1], usage["completion_tokens"]

        def native() -> tuple[int, str, int]:
            r = c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 10000,
                                                                             "ignore_eos": True}})
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": ctx - meta["prompt_tokens"]}, meta
            return meta["prompt_tokens"], "length", meta["completion_tokens"]

        with cf.ThreadPoolExecutor(3) as ex:
            outs = [f.result() for f in [ex.submit(fn) for fn in (completion, chat_stream, native)]]
        print(f"\ncontext {ctx}: (prompt, finish, completion) per route {outs}")
        for prompt_tokens, finish, completion_tokens in outs:
            assert finish == "length"
            assert prompt_tokens + completion_tokens == ctx, outs
        idle_invariants(srv)
