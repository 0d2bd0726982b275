"""The server, scheduler and model runner (``radixlm.runtime``)."""

if "." not in __name__:  # imported as top-level ``runtime`` from a checkout's root: not us
    from radixlm import _defer_to_top_level

    _defer_to_top_level(__name__, __file__)
