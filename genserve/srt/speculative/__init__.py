"""Speculative decoding: cheap proposals for a request's next tokens, checked by one forward of
the target model, so a decode step can emit several tokens.

`ngram.py` proposes tokens by prompt lookup (the request's own prompt and output), one chain
or a tree of several candidates (`tree.py`: the trie, its attention mask and its acceptance);
`draft.py` by a smaller model with the same tokenizer (loaded by `draft_model.py`), whose KV
lives in a pool of its own; `adaptive.py` decides per request how long a draft pays and stops
a request whose drafts keep failing; `verify.py` accepts or rejects them so that greedy output
is unchanged and sampled output keeps the target distribution; `grammar_verify.py` cuts a
constrained request's draft at its grammar and masks each verify row; the scheduler
(`scheduler/speculative.py`) runs the verify forward and returns rejected tokens' KV slots.
"""

from typing import Any

from genserve.srt.speculative.ngram import NgramProposer
from genserve.srt.speculative.verify import can_speculate, verify_draft

__all__ = ["NgramProposer", "can_speculate", "refuse_vision_target", "verify_draft"]


def refuse_vision_target(multimodal: Any) -> None:
    """ValueError when the target is a vision-language model (`multimodal`: its
    `ModelConfig.multimodal`, None for a text model): no proposer handles image tokens."""
    if multimodal:
        raise ValueError("speculative decoding is not supported for vision-language models; "
                         "drop --speculative-algorithm")
