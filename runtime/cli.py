"""The ``radixlm`` console script: ``radixlm launch_server ...``, ``radixlm bench ...``."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: radixlm <command> [options]

commands:
  launch_server   start the HTTP server (see `radixlm launch_server --help`)
  serve-ray       servers on Ray Serve behind a prefix-cache-aware router
                  (`radixlm serve-ray --replicas 2 -- <launch_server flags>`; needs the `serve` extra)
  bench           benchmarks: `radixlm bench cache-sim`, `radixlm bench serving`,
                  `radixlm bench serving-plot` (see `radixlm bench --help`)
  calibrate_kv_scales
                  measure FP8 KV-cache scales and write them for `launch_server --kv-scales-path`
"""

BENCH_USAGE = """usage: radixlm bench <benchmark> [options]

benchmarks:
  cache-sim   replay request traces against the radix tree at several page budgets:
              token hit rate per eviction policy vs Belady's offline optimum
  serving     load a server (or a transformers baseline) with ShareGPT / random /
              generated-shared-prefix / multi-turn requests: throughput, TTFT, TPOT,
              ITL, prefix-cache hit rate, KV usage (flags as SGLang's bench_serving)
  serving-plot
              TTFT / ITL / throughput versus request rate from `serving` JSONL records
"""


def _bench_main(name: str):
    if name == "cache-sim":
        from radixlm.runtime.bench.cache_sim import main
    elif name == "serving":
        from radixlm.runtime.bench.serving import main
    elif name == "serving-plot":
        from radixlm.runtime.bench.serving import plot_main as main
    else:
        return None
    return main


def _bench(argv: list[str]) -> None:
    main = _bench_main(argv[0]) if argv else None
    if main is not None:
        code = main(argv[1:])
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
    if command in ("serve-ray", "serve_ray"):
        from radixlm.runtime.deploy.app import main as serve_ray

        sys.exit(serve_ray(rest))
    if command == "bench":
        _bench(rest)
        return
    if command in ("calibrate_kv_scales", "calibrate-kv-scales"):
        from radixlm.runtime.executor.kv_calibration import main as calibrate

        sys.exit(calibrate(rest))
    print(f"radixlm: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":  # python -m radixlm.runtime.cli ...
    main()
