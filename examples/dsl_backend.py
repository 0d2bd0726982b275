"""Shared by the DSL examples: ``--url`` of a running server, or start one.

    backend = backend_from_args(args)   # RuntimeEndpoint(args.url) or Runtime()
"""

from __future__ import annotations

import argparse

from radixlm.frontend import Backend, Runtime, RuntimeEndpoint


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None,
                        help="a running radixlm server (default: start one with the default model)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")


def backend_from_args(args: argparse.Namespace) -> Backend:
    """A RuntimeEndpoint to ``--url``, or a Runtime (a server started here, stopped at
    exit; SmolLM2-135M-Instruct on CPU unless the server defaults say otherwise)."""
    if args.url:
        return RuntimeEndpoint(args.url, api_key=args.api_key)
    print("starting a radixlm server (SmolLM2-135M-Instruct) ...", flush=True)
    return Runtime(max_total_tokens=8192)
