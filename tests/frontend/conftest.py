"""Frontend fixtures: a real server (the e2e ``server_factory``) and backends to it.

The e2e conftest's fixtures are loaded from its file (its directory is not a parent of
this one); ``dsl_server`` is a server of its own with a small KV pool, shared by every
frontend test module.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixlm.frontend import OpenAI, RuntimeEndpoint

_spec = importlib.util.spec_from_file_location("_e2e_conftest", Path(__file__).parents[1] / "e2e" / "conftest.py")
_e2e = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _e2e  # dataclasses look their module up there
_spec.loader.exec_module(_e2e)

server_factory = _e2e.server_factory
idle_invariants = _e2e.idle_invariants


@pytest.fixture(scope="session")
def dsl_server(server_factory) -> Iterator:
    with server_factory(chunked_prefill_size=512, max_total_tokens=8192) as srv:
        yield srv


@pytest.fixture(scope="session")
def endpoint(dsl_server) -> RuntimeEndpoint:
    return RuntimeEndpoint(dsl_server.url)


@pytest.fixture(scope="session")
def openai_backend(dsl_server) -> OpenAI:
    return OpenAI("default", base_url=f"{dsl_server.url}/v1")
