"""Grammar-constrained decoding (json_schema / regex / ebnf) with xgrammar.

`GrammarBackend` compiles grammars in a worker thread, cached by key, so the scheduler's step
never waits on a compile; each constrained request gets a `RequestGrammar` (its own matcher)
that fills its row of the token bitmask the sampler applies.
"""

from genserve.srt.constrained.grammar_backend import (
    GrammarBackend,
    GrammarError,
    RequestGrammar,
    create_grammar_backend,
)

__all__ = ["GrammarBackend", "GrammarError", "RequestGrammar", "create_grammar_backend"]
