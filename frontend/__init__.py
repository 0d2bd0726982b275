"""radixlm's frontend DSL: LLM programs under SGLang's names (no torch import).

See ``api`` for the language, ``interpreter`` for how programs run, ``choices`` for how
``select`` scores options, and the backends ``runtime_endpoint`` (radixlm's native API;
``Runtime`` starts a server), ``engine`` (``Engine``: the runtime in this process, no
HTTP; imports torch when created), ``openai_backend`` (OpenAI-compatible APIs).
"""

if "." not in __name__:  # imported as top-level ``frontend`` from a checkout's root: not us
    from radixlm_pkg import (
        _defer_to_top_level,  # the checkout's own copy: radixlm may not be installed
    )

    _defer_to_top_level(__name__, __file__)
else:
    from radixlm.frontend.api import (
        Function,
        assistant,
        assistant_begin,
        assistant_end,
        flush_cache,
        function,
        gen,
        get_default_backend,
        select,
        set_default_backend,
        system,
        system_begin,
        system_end,
        user,
        user_begin,
        user_end,
    )
    from radixlm.frontend.backend import Backend
    from radixlm.frontend.chat_template import ChatTemplate
    from radixlm.frontend.choices import sum_logprob, token_length_normalized
    from radixlm.frontend.engine import Engine
    from radixlm.frontend.interpreter import ProgramState, ProgramStateGroup
    from radixlm.frontend.ir import SamplingParams
    from radixlm.frontend.openai_backend import OpenAI
    from radixlm.frontend.runtime_endpoint import Runtime, RuntimeEndpoint
    from radixlm.frontend.transport import BackendError

__all__ = [
    "function", "Function", "gen", "select", "system", "user", "assistant", "system_begin",
    "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "flush_cache", "RuntimeEndpoint", "Runtime", "Engine",
    "OpenAI", "Backend", "BackendError", "ChatTemplate", "ProgramState", "ProgramStateGroup",
    "SamplingParams", "token_length_normalized", "sum_logprob",
]
