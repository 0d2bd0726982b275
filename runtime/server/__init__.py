"""The tokenizer process: HTTP routes (native and OpenAI), request validation, the
tokenizer manager (tokenize, chat template, incremental detokenize) and Prometheus metrics.

Imports the shared ``messages`` / ``ipc`` modules, ``server_args`` and ``text``; never the
scheduler, executor or memory packages (they live in the other process), not even through
the config (tests/test_layering.py).
"""
