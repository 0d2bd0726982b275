"""``Engine``: the model in this process, no HTTP server (SGLang's ``sgl.Engine``).

``Engine(**server_flags)`` builds ``ServerArgs`` from the launcher's flags as keywords
(``model_path=None`` for the default SmolLM2, ``device``, ``max_total_tokens``,
``page_size`` ...) and starts ``runtime.engine.LocalServer``: the scheduler loop on one
daemon thread and the server's tokenizer manager on an asyncio loop on another, joined
by ZeroMQ ipc:// sockets. It is a ``RuntimeEndpoint`` whose transport calls the native
routes' handlers directly: the same results, stream events and error messages
(``BackendError`` with the HTTP status the route would answer) as a server started with
the same flags, without a port or a subprocess.

The runtime (torch) is imported by ``Engine()``, not by importing this module, so
``radixlm.frontend`` stays torch-free. On CPU the model's forward sets torch's thread
count for the whole process (``ModelRunner``: one core is left free).
"""

from __future__ import annotations

import atexit
from typing import Any

from radixlm.frontend.runtime_endpoint import RuntimeEndpoint
from radixlm.frontend.transport import BackendError

__all__ = ["Engine"]


class Engine(RuntimeEndpoint):
    """A radixlm server in this process. ``server_flags``: ``ServerArgs`` fields
    (``radixlm launch_server --help``; HTTP-only ones such as ``port`` are ignored);
    ``tokenizer_path``: overrides the tokenizer directory the frontend reads (default:
    the model's). Blocks until the model is loaded. Raises TypeError for an unknown flag,
    ValueError for inconsistent flags (the launcher's message), RuntimeError if the model
    fails to load (the scheduler's error). ``shutdown()`` (also at exit, or leaving a
    ``with`` block) stops the threads and frees the model; a new Engine may follow."""

    def __init__(self, tokenizer_path: str | None = None, **server_flags: Any) -> None:
        from radixlm.runtime.engine import LocalServer
        from radixlm.runtime.server_args import ServerArgs

        args = ServerArgs(**server_flags)
        args.validate()
        self.server_args = args
        self.server = LocalServer(args, error=BackendError)
        atexit.register(self.shutdown)
        self.base_url = None
        try:
            self._connect(self.server, tokenizer_path)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the scheduler and event-loop threads (requests still running fail with
        BackendError) and drop the model. Idempotent."""
        self.server.close()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
