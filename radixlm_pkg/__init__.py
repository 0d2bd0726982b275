"""radixlm: an LLM serving runtime built around RadixAttention.

Subpackages: ``radixlm.radix`` (torch-free radix tree), ``radixlm.kernels`` (attention ops),
``radixlm.runtime`` (server, scheduler, model runner), ``radixlm.frontend`` (DSL).
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"
__all__ = ["__version__"]


def _defer_to_top_level(name: str, init_file: str) -> None:
    """Called by a checkout folder's ``__init__.py`` (``init_file``) when it is imported as
    the top-level package ``name`` rather than as ``radixlm.name``. The folders
    ``kernels/``, ``runtime/``, ``radix/``, ``frontend/`` are ``radixlm.*`` packages only
    (pyproject's package-dir), but ``python -c`` / ``python -m`` / a script run in the
    checkout put its root first on sys.path, and then ``import kernels`` inside transformers
    (>= 5.25 imports Hugging Face's ``kernels`` package) found ours and failed with "cannot
    import name 'CUDAProperties' from 'kernels'". Imports ``name`` again with the root off
    sys.path, so the import statement gets what it would without the checkout (another
    distribution's package) or its ModuleNotFoundError; sys.path is then restored (files
    beside a script in the checkout stay importable).

    Without such a package the import gives an empty namespace package (``__file__`` None,
    no attributes), what a plain folder on sys.path gives, rather than ModuleNotFoundError:
    transformers' availability check finds the folder's spec, imports it, and counts a
    namespace package as absent, but lets a ModuleNotFoundError through (transformers 5.17
    on the GPU host, where Hugging Face's ``kernels`` is not installed, failed to import
    LlamaConfig that way)."""
    import importlib
    import importlib.machinery
    import types

    root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(init_file))))
    saved = list(_sys.path)
    _sys.path[:] = [p for p in saved if _os.path.realpath(p or _os.curdir) != root]
    try:
        del _sys.modules[name]
        try:
            _sys.modules[name] = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            namespace = types.ModuleType(name)
            namespace.__file__ = None
            namespace.__path__ = []
            namespace.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            _sys.modules[name] = namespace
    finally:
        _sys.path[:] = saved + [p for p in _sys.path if p not in saved]
