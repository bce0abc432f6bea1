"""genserve.lang: LLM programs as Python functions (the frontend half of the SGLang paper).

    from genserve.lang import function, gen, select, user, assistant, RuntimeEndpoint

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=32))

    state = qa.run(question="What is the capital of France?",
                   backend=RuntimeEndpoint("http://127.0.0.1:30000"), temperature=0)
    print(state["answer"])

`gen`, `select` and `fork` let the runtime share prefixes across calls and branches through its
radix cache. See docs/lang.md.
"""

from genserve.lang.backends import Backend, EngineBackend, ProgramError, RuntimeEndpoint
from genserve.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from genserve.lang.program import Program, function, set_default_backend
from genserve.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend", "EngineBackend", "ForkGroup", "Program", "ProgramError", "ProgramState",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "function", "gen",
    "image", "select", "set_default_backend", "system", "system_begin", "system_end", "user",
    "user_begin", "user_end",
]
