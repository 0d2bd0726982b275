"""The ``radixlm`` console script: ``radixlm launch_server ...``."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: radixlm <command> [options]

commands:
  launch_server   start the HTTP server (see `radixlm launch_server --help`)
"""


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
    print(f"radixlm: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    sys.exit(2)
