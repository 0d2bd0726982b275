"""The ``radixlm`` console script: ``radixlm launch_server ...``, ``radixlm bench ...``."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: radixlm <command> [options]

commands:
  launch_server   start the HTTP server (see `radixlm launch_server --help`)
  bench           benchmarks: `radixlm bench cache-sim` (see its --help)
"""

BENCH_USAGE = """usage: radixlm bench <benchmark> [options]

benchmarks:
  cache-sim   replay request traces against the radix tree at several page budgets:
              token hit rate per eviction policy vs Belady's offline optimum
"""


def _bench(argv: list[str]) -> None:
    if argv and argv[0] == "cache-sim":
        from radixlm.runtime.cache_sim import main as cache_sim

        code = cache_sim(argv[1:])
        if code:
            sys.exit(code)
        return
    if argv and argv[0] in ("-h", "--help"):
        print(BENCH_USAGE)
        sys.exit(0)
    unknown = f"radixlm bench: unknown benchmark {argv[0]!r}\n\n" if argv else ""
    print(f"{unknown}{BENCH_USAGE}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command in ("launch_server", "launch-server", "serve"):
        from radixlm.runtime.launch_server import main as launch

        launch(rest)
        return
    if command == "bench":
        _bench(rest)
        return
    print(f"radixlm: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    sys.exit(2)
