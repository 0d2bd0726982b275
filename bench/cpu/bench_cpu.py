"""CPU benchmark (``make bench``): radixlm vs Hugging Face transformers, side by side in
one run, on SmolLM2-135M-Instruct: radixlm serves its defaults (the GGUF's weight kinds:
int4 linears, int8 LM head; ``--server-args "--weight-dtype model"`` for float32),
transformers the float32 directory radixlm converted the GGUF into (``/get_model_info``).

(a) Decode speed at batch 1 and batch 8, fixed output length (EOS ignored), seeded random
    prompt token ids (each request its own prompt, so nothing is shared):
    - radixlm: ``POST /generate`` with ``stream=true`` and ``ignore_eos``; batch B = B
      concurrent requests. Streaming timestamps separate the phases: TTFT = send -> first
      token, TPOT = (last token - first token) / (output_len - 1); decode tokens/s =
      B / median TPOT (one decode step yields B tokens).
    - transformers ``generate`` (greedy, ``min_new_tokens = max_new_tokens``), batch 1
      and a batch of B equal-length prompts (left padding, none needed): prefill time =
      a ``max_new_tokens=1`` call, decode tokens/s = B (N - 1) / (T(N) - T(1)).
    Both also report end-to-end output tokens/s (all output tokens / wall time, prefill
    included). transformers runs with the radixlm scheduler's torch thread count
    (``model_loader.cpu_threads``) and with torch's default.
(b) The multi-turn ShareGPT replay of ``examples/sharegpt_multiturn.py`` (imported, one
    implementation) with the radix cache on and off (``--disable-radix-cache``), same
    conversations: TTFT per turn index (mean / median) and the prefix-cache hit rates.

Order: server with radix cache -> (a) radixlm, (b) on -> stop; (a) transformers with no
server running; server without radix cache -> (b) off -> stop. Results: a JSON file and a
PNG plot under bench/results/, a markdown table on stdout.

    .venv/bin/python bench/cpu/bench_cpu.py          # = make bench (~15 min on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from radixlm.runtime.executor.model_loader import cpu_threads

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is bench/cpu/bench_cpu.py)
RESULTS_DIR = ROOT / "bench" / "results"
PROMPT_ID_FLOOR = 100  # random prompt ids stay clear of the special tokens


def _load_example() -> ModuleType:
    """examples/ is not a package: load the replay module from its file."""
    path = ROOT / "examples" / "sharegpt_multiturn.py"
    spec = importlib.util.spec_from_file_location("sharegpt_multiturn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


replay = _load_example()


# ----------------------------------------------------------------------------- environment
def _git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    import torch
    import transformers

    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_default_threads": torch.get_num_threads(),
        "radixlm_scheduler_threads": cpu_threads(),
        "loadavg_start": os.getloadavg(),
    }


# ----------------------------------------------------------------------------- decode
@dataclass(frozen=True)
class DecodeRun:
    """One measurement: ``batch`` requests of ``prompt_len`` -> ``output_len`` tokens."""

    engine: str
    threads: int
    batch: int
    ttft_s: float
    tpot_s: float
    decode_tok_s: float
    e2e_tok_s: float


@dataclass(frozen=True)
class _Stream:
    sent: float
    first: float
    last: float
    tokens: int


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_ID_FLOOR, vocab) for _ in range(length)] for _ in range(count)]


def _stream_generate(url: str, ids: list[int], output_len: int) -> _Stream:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
    }
    sent = time.perf_counter()
    first = last = float("nan")
    tokens = 0
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if len(event["output_ids"]) > tokens:
                last = time.perf_counter()
                first = last if tokens == 0 else first
                tokens = len(event["output_ids"])
    if tokens != output_len:
        raise RuntimeError(f"expected {output_len} tokens, got {tokens}")
    return _Stream(sent, first, last, tokens)


def radixlm_decode(url: str, prompts: list[list[int]], output_len: int, threads: int) -> DecodeRun:
    """All prompts at once as concurrent streaming requests."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda p: _stream_generate(url, p, output_len), prompts))
    batch = len(prompts)
    tpot = statistics.median((s.last - s.first) / (s.tokens - 1) for s in streams)
    wall = max(s.last for s in streams) - min(s.sent for s in streams)
    return DecodeRun(
        "radixlm",
        threads,
        batch,
        statistics.median(s.first - s.sent for s in streams),
        tpot,
        batch / tpot,
        batch * output_len / wall,
    )


def _hf_generate_s(model: Any, ids: Any, new_tokens: int) -> float:
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=2,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return elapsed


def hf_decode(model: Any, prompts: list[list[int]], output_len: int, threads: int) -> DecodeRun:
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts)  # equal lengths: the left-padded batch needs no padding
    batch = len(prompts)
    t1 = _hf_generate_s(model, ids, 1)
    tn = _hf_generate_s(model, ids, output_len)
    decode = tn - t1
    return DecodeRun(
        "transformers",
        threads,
        batch,
        t1,
        decode / (output_len - 1),
        batch * (output_len - 1) / decode,
        batch * output_len / tn,
    )


def _median_run(runs: list[DecodeRun]) -> DecodeRun:
    med = {
        k: statistics.median(getattr(r, k) for r in runs)
        for k in ("ttft_s", "tpot_s", "decode_tok_s", "e2e_tok_s")
    }
    return DecodeRun(runs[0].engine, runs[0].threads, runs[0].batch, **med)


def measure(
    fn: Callable[[list[list[int]]], DecodeRun],
    batch: int,
    args: argparse.Namespace,
    vocab: int,
    label: str,
) -> dict[str, Any]:
    """Warm-up, then ``args.repeats`` runs with fresh prompts; the median, the raw runs and
    the 1-minute load average before and after (the machine may be shared)."""
    print(f"--- decode: {label}, batch {batch}", flush=True)
    load_before = os.getloadavg()[0]
    fn(random_prompts(batch, args.prompt_len, vocab, seed=-1))
    runs = [
        fn(random_prompts(batch, args.prompt_len, vocab, seed=batch * 1000 + i))
        for i in range(args.repeats)
    ]
    return {
        "median": asdict(_median_run(runs)),
        "runs": [asdict(r) for r in runs],
        "loadavg_1min": [load_before, os.getloadavg()[0]],
    }


def hf_suite(
    model_path: str, args: argparse.Namespace, env: dict[str, Any], vocab: int
) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    default = [env["radixlm_scheduler_threads"], env["torch_default_threads"]]
    for threads in sorted(set(args.hf_threads or default)):
        for batch in args.batch_sizes:
            fn = partial(hf_decode, model, output_len=args.output_len, threads=threads)
            out.append(measure(fn, batch, args, vocab, f"transformers, {threads} torch threads"))
    torch.set_num_threads(env["torch_default_threads"])
    return out


# ----------------------------------------------------------------------------- replay
def replay_suite(url: str, cfg: Any, label: str) -> dict[str, Any]:
    replay.flush_cache(url)
    print(f"--- multi-turn replay, radix cache {label}", flush=True)
    results, summary = replay.run_replay(url, cfg)
    return {
        "label": label,
        "summary": asdict(summary),
        "hit_rate": summary.hit_rate,
        "best_hit_rate": summary.best_hit_rate,
        "failed": summary.failed,
        "turns": [asdict(r) for r in results],
    }


# ----------------------------------------------------------------------------- output
def decode_table(rows: list[dict], prompt_len: int, output_len: int) -> str:
    lines = [
        "| engine | torch threads | batch | in / out tokens | TTFT (s) | TPOT (ms) | "
        "decode tok/s | end-to-end output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["median"]
        lines.append(
            f"| {m['engine']} | {m['threads']} | {m['batch']} | {prompt_len} / {output_len} | "
            f"{m['ttft_s']:.3f} | {m['tpot_s'] * 1e3:.1f} | {m['decode_tok_s']:.1f} | "
            f"{m['e2e_tok_s']:.1f} |"
        )
    return "\n".join(lines)


def replay_table(on: dict, off: dict) -> str:
    lines = [
        "| turn | requests | TTFT mean on / off (s) | TTFT median on / off (s) | "
        "median on/off | hit rate on | hit rate off | best achievable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    off_turns = {t["turn"]: t for t in off["summary"]["per_turn"]}
    for a in on["summary"]["per_turn"]:
        b = off_turns[a["turn"]]
        lines.append(
            f"| {a['turn']} | {a['count']} | {a['mean_ttft_s']:.3f} / {b['mean_ttft_s']:.3f} | "
            f"{a['median_ttft_s']:.3f} / {b['median_ttft_s']:.3f} | "
            f"{a['median_ttft_s'] / b['median_ttft_s']:.2f} | "
            f"{a['cached_tokens'] / max(a['prompt_tokens'], 1):.1%} | "
            f"{b['cached_tokens'] / max(b['prompt_tokens'], 1):.1%} | "
            f"{a['best_cached_tokens'] / max(a['prompt_tokens'], 1):.1%} |"
        )
    lines.append(
        f"| all | {on['summary']['turns']} | | | | {on['hit_rate']:.1%} | "
        f"{off['hit_rate']:.1%} | {on['best_hit_rate']:.1%} |"
    )
    return "\n".join(lines)


def plot(on: dict, off: dict, decode: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for res, color in ((on, "tab:blue"), (off, "tab:red")):
        turns = [t["turn"] for t in res["summary"]["per_turn"]]
        ax1.plot(
            turns,
            [t["median_ttft_s"] for t in res["summary"]["per_turn"]],
            "o-",
            color=color,
            label=f"radix cache {res['label']} (median)",
        )
        ax1.plot(
            turns,
            [t["mean_ttft_s"] for t in res["summary"]["per_turn"]],
            "x--",
            color=color,
            alpha=0.6,
            label=f"radix cache {res['label']} (mean)",
        )
    ax1.set(
        xlabel="turn", ylabel="TTFT (s)", title="multi-turn ShareGPT: TTFT per turn", ylim=(0, None)
    )
    ax1.set_xticks(turns)
    ax1.legend(fontsize=8)
    labels = [
        f"{r['median']['engine']}\n{r['median']['threads']} thr, b{r['median']['batch']}"
        for r in decode
    ]
    ax2.bar(
        range(len(decode)),
        [r["median"]["decode_tok_s"] for r in decode],
        color=["tab:blue" if r["median"]["engine"] == "radixlm" else "tab:gray" for r in decode],
    )
    ax2.set_xticks(range(len(decode)), labels, fontsize=7)
    ax2.set(ylabel="decode tokens/s", title="decode throughput")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0].replace("\n", " "))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--repeats", type=int, default=3, help="decode measurements per setting (median)"
    )
    p.add_argument(
        "--hf-threads",
        type=int,
        nargs="+",
        help="torch threads for transformers (default: the scheduler's count and torch's default)",
    )
    p.add_argument("--server-args", default="", help="extra launch_server flags for both servers")
    replay.add_replay_args(p)
    return p.parse_args(argv)


def _with_server(extra: str, log_name: str, fn: Callable[[str], Any]) -> Any:
    log_path = Path(tempfile.gettempdir()) / log_name
    with open(log_path, "w") as log, replay.launched_server(shlex.split(extra), log) as (url, stop):
        out = fn(url)
        print(f"server stopped (exit code {stop()}; log {log_path})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cfg = replay.config_from_args(args)
    env = environment()
    threads = env["radixlm_scheduler_threads"]
    state: dict[str, Any] = {}

    def radix_on(url: str) -> None:
        info = replay.model_info(url)
        state["info"], vocab = info, replay.load_tokenizer(info).vocab_size
        fn = partial(radixlm_decode, url, output_len=args.output_len, threads=threads)
        state["radixlm"] = [measure(fn, b, args, vocab, "radixlm") for b in args.batch_sizes]
        state["on"] = replay_suite(url, cfg, "on")

    _with_server(args.server_args, "radixlm-bench-on.log", radix_on)
    vocab = replay.load_tokenizer(state["info"]).vocab_size
    state["hf"] = hf_suite(state["info"]["model_dir"], args, env, vocab)
    state["off"] = _with_server(
        f"{args.server_args} --disable-radix-cache",
        "radixlm-bench-off.log",
        lambda url: replay_suite(url, cfg, "off"),
    )
    env["loadavg_end"] = os.getloadavg()
    return _report(args, cfg, env, state)


def _report(args: argparse.Namespace, cfg: Any, env: dict, state: dict) -> int:
    decode = state["radixlm"] + state["hf"]
    stamp = env["date"].replace(":", "").replace("-", "")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    png = RESULTS_DIR / f"bench_cpu-{stamp}.png"
    title = (
        f"SmolLM2-135M-Instruct (radixlm {args.server_args or 'defaults'}, transformers fp32), "
        f"{env['cpu']} x{env['nproc']}, commit {env['commit']}, "
        f"{env['date']}"
    )
    plot(state["on"], state["off"], decode, png, title)
    result = {
        "env": env,
        "args": vars(args),
        "replay_config": asdict(cfg),
        "model_info": state["info"],
        "decode": decode,
        "replay_on": state["on"],
        "replay_off": state["off"],
        "plot": str(png.relative_to(ROOT)),
    }
    out = RESULTS_DIR / f"bench_cpu-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"\n{title}; load average {env['loadavg_start']} -> {env['loadavg_end']}\n")
    print(decode_table(decode, args.prompt_len, args.output_len), "\n")
    print(replay_table(state["on"], state["off"]))
    print(f"\nresults: {out.relative_to(ROOT)}, plot: {png.relative_to(ROOT)}")
    return 1 if state["on"]["failed"] or state["off"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
