"""radixlm.radix must stay importable without torch (or any non-stdlib module)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
before = set(sys.modules)
import radixlm.radix
assert 'torch' not in sys.modules, 'radixlm.radix imported torch'
new = {name.split('.')[0] for name in set(sys.modules) - before}
extra = new - set(sys.stdlib_module_names) - {'radixlm'}
assert not extra, f'non-stdlib imports: {sorted(extra)}'
"""


def test_import_is_torch_free_and_stdlib_only() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
