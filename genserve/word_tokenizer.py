"""The word-level tokenizer every tiny and demo model uses (no torch).

One word, newline or punctuation mark is one token; unknown words map to `unk`. Built in memory
(`tokenizers` + `transformers.PreTrainedTokenizerFast`), so a model folder saved with it loads in
stock transformers / diffusers like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# whitespace: split on spaces and punctuation (the text encoders of the diffusion models);
# bytelevel: GPT-2's byte-level pieces ("Ġword" = a word after a space), so decoding is exact
# (the chat models); words-and-marks: every newline, word and punctuation mark, spaces dropped
# (Qwen's chat markup, whose prompt prefix must be a known number of tokens).
SPLITS = ("whitespace", "bytelevel", "words-and-marks")


def word_tokenizer(vocab: Sequence[str], *, unk: str, split: str = "whitespace",
                   lowercase: bool = True, template: str | None = None,
                   markers: Sequence[str] = (), **fast_kwargs: Any):
    """A `PreTrainedTokenizerFast` over `vocab` (token i has id i).

    `template`: the post-processor's single-sequence template ("<s> $A </s>": the encoders pool
    or attend up to the end-of-text token, as CLIP and T5 do); None adds nothing. `markers`:
    tokens matched verbatim before splitting (chat markers). `fast_kwargs` go to
    `PreTrainedTokenizerFast` (pad / eos / bos tokens, model_max_length...).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ids = {tok: i for i, tok in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token=unk))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    if split == "whitespace":
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    elif split == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|\w+|[^\w\s]"), behavior="removed",
                                                 invert=True)
    if template is not None:
        specials = [(t, ids[t]) for t in template.split() if t != "$A"]
        tok.post_processor = processors.TemplateProcessing(single=template,
                                                           special_tokens=specials)
    if markers:
        tok.add_special_tokens([AddedToken(m, normalized=False, special=True) for m in markers])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk, **fast_kwargs)
