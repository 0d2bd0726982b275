"""radixlm on Ray Serve (``radixlm serve-ray``, ``serve run radixlm.runtime.deploy.app:build_app``):
replicas that each run one radixlm server, behind an ingress that serves the same HTTP API
and a prefix-cache-aware request router (docs/SERVING.md "Ray Serve").

* ``child``: the server process a replica starts (``launch_server`` that dies with its replica);
* ``replica``: ``RadixLMServer``, the replica: starts the server, proxies requests to it,
  reports health, load and its KV event endpoints to the router;
* ``router``: ``PrefixCacheRouter``, Ray Serve's request-router interface over the cache-aware
  policy (radix/routing.py) and the servers' KV events (runtime/kv_events.py);
* ``ingress``: ``RadixLMIngress``, the HTTP routes (every server route, streaming included);
  tokenizes prompts for routing, retries requests that never started, broadcasts admin calls;
* ``app``: ``DeployConfig`` (flags and config-file arguments), ``build_app`` and the CLI.

Ray is imported by ``router``, ``ingress`` and ``app`` only (the ``serve`` extra).
"""
