"""radixlm: an LLM serving runtime built around RadixAttention.

Subpackages: ``radixlm.radix`` (torch-free radix tree), ``radixlm.kernels`` (attention ops),
``radixlm.runtime`` (server, scheduler, model runner), ``radixlm.frontend`` (DSL).
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"
__all__ = ["__version__"]


def _unshadow_checkout() -> None:
    """Take a source checkout's root off ``sys.path``. Its folders ``kernels/``,
    ``runtime/``, ``radix/``, ``frontend/`` are ``radixlm.*`` packages (pyproject's
    package-dir), never top-level ones, but ``python -m`` / ``python -c`` run from the
    checkout put its root first on ``sys.path``, and then ``import kernels`` inside
    transformers (>= 5.25 imports Hugging Face's ``kernels`` package) finds ours and fails
    with "cannot import name 'CUDAProperties' from 'kernels'". radixlm itself is found
    through the installed distribution (editable or not), so nothing needs that entry."""
    package_dir = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.basename(package_dir) != "radixlm_pkg":
        return  # an installed copy (site-packages/radixlm), not a checkout
    root = _os.path.dirname(package_dir)
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != root]



def _defer_to_top_level(name: str, init_file: str) -> None:
    """Called by a checkout folder's ``__init__.py`` (``init_file``) when it is imported as
    the top-level package ``name`` rather than as ``radixlm.name``: its checkout root was
    first on sys.path. Takes that root off sys.path and imports ``name`` again, so the
    import statement gets what it would without the checkout (another distribution's
    package, e.g. Hugging Face's ``kernels``) or its ModuleNotFoundError."""
    import importlib

    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(init_file)))
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != root]
    del _sys.modules[name]
    _sys.modules[name] = importlib.import_module(name)


_unshadow_checkout()
