"""Benchmark tools behind ``radixlm bench``: the serving client (``serving``), the
transformers baselines (``hf_baseline``), workloads (``datasets``, ``sharegpt``,
``cache_traces``), the cache simulator (``cache_sim``), and ``server_process`` (start and
stop a server in a subprocess, for benchmarks, examples and tests).

Imports no scheduler, executor or server module at import time.
"""
