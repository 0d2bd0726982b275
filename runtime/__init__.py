"""The server, scheduler and model runner (``radixlm.runtime``)."""

if "." not in __name__:  # imported as top-level ``runtime`` from a checkout's root: not us
    from radixlm_pkg import (
        _defer_to_top_level,  # the checkout's own copy: radixlm may not be installed
    )

    _defer_to_top_level(__name__, __file__)
