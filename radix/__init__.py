"""Torch-free, page-aligned radix tree: token-id prefixes -> KV page ids.

``RadixTree`` (radix/tree.py) does match/insert/split/lock/evict; eviction policies are
looked up by name in ``EVICTION_POLICIES`` (radix/eviction.py); ``RadixTree.check_invariants``
runs ``check_tree`` (radix/invariants.py). Imports only the standard library.
"""

from __future__ import annotations

if "." not in __name__:  # imported as top-level ``radix`` from a checkout's root: not us
    from radixlm_pkg import (
        _defer_to_top_level,  # the checkout's own copy: radixlm may not be installed
    )

    _defer_to_top_level(__name__, __file__)
else:
    from radixlm.radix.eviction import EVICTION_POLICIES
    from radixlm.radix.tree import InsertResult, MatchResult, PeekResult, RadixTree, TreeListener

__all__ = ["EVICTION_POLICIES", "InsertResult", "MatchResult", "PeekResult", "RadixTree", "TreeListener"]
