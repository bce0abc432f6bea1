"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer (byte-level BPE)
and a SentencePiece-style tokenizer with byte fallback built inline."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from genserve.srt.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Héllo wörld! Ça va? Ñandú, señor — naïve café.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 end.",
    "日本語のテキストと中文字符，还有한국어。",
    "Math 𝔘nicode ∑ x² ≤ ∞, Greek αβγ, Cyrillic Привет.",
]


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_folder):
    # The tokenizer of the folder the server converted from the GGUF (cached by the first test
    # that loads SmolLM2): the one serving uses, without rebuilding it from the GGUF (~10 s).
    return AutoTokenizer.from_pretrained(smollm_folder)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """Llama-style: "▁" for spaces, characters outside the vocab fall back to <0xNN> bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?:'-é":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "w"), ("o", "r"), ("▁w", "or")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(tokenizer, ids: list[int], chunk: int = 1, skip_special_tokens: bool = True):
    """Feed ids `chunk` at a time; yield (ids so far, cumulative text)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    for i in range(0, len(ids), chunk):
        yield ids[: i + chunk], detok.add(ids[i : i + chunk])


def check_matches_full_decode(tokenizer, ids: list[int], chunk: int = 1, skip=True) -> int:
    """Assert the incremental text equals decode(all ids) at every step, less an incomplete
    trailing character; return how many steps had one."""
    held = 0
    text = ""
    for so_far, text in stream(tokenizer, ids, chunk, skip):
        full = tokenizer.decode(so_far, skip_special_tokens=skip)
        assert not text.endswith("\ufffd")
        if full.endswith("\ufffd"):
            held += 1
        assert text == full.rstrip("\ufffd")
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    return held


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_incremental_equals_full_decode(smollm_tokenizer, text):
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    held = check_matches_full_decode(smollm_tokenizer, ids)
    # Each of these texts has a character whose bytes span tokens, so the hold-back was used.
    assert held > 0
    check_matches_full_decode(smollm_tokenizer, ids, chunk=3)


def test_smollm_special_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    body = tok.encode("Olá 😀 mundo", add_special_tokens=False)
    ids = [tok.convert_tokens_to_ids("<|im_start|>")] + body + [tok.eos_token_id]
    check_matches_full_decode(tok, ids, skip=True)
    check_matches_full_decode(tok, ids, skip=False)
    assert "<|im_start|>" in tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", ["Hello world, café 日本 😀 ok.", "wor world worlds é!"])
@pytest.mark.parametrize("chunk", [1, 2])
def test_sentencepiece_byte_fallback(sentencepiece_tokenizer, text, chunk):
    tok = sentencepiece_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    previous = ""
    for so_far, streamed in stream(tok, ids, chunk):
        full = tok.decode(so_far)
        assert not streamed.endswith("\ufffd")
        assert streamed.startswith(previous) and text.startswith(streamed)
        if "\ufffd" not in full:
            assert streamed == full
        previous = streamed
    assert previous == text


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_work_per_step_is_bounded(smollm_tokenizer):
    ids = smollm_tokenizer.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    assert len(ids) > 200
    counting = CountingTokenizer(smollm_tokenizer)
    detok = IncrementalDetokenizer(counting)
    for token in ids:
        text = detok.add([token])
    assert text == smollm_tokenizer.decode(ids, skip_special_tokens=True)
    # Windows cover only the last step's tokens plus held-back bytes, never the whole output.
    assert max(counting.sizes) <= 12


def test_flush_emits_held_back_bytes(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    text = detok.add(ids[:-1])  # the emoji's last byte is missing
    assert text == "ok "  # everything but the incomplete emoji
    assert detok.flush() == tok.decode(ids[:-1])
    assert detok.flush().endswith("\ufffd")


# ------------------------------------------------------------------------------ stop strings


def test_stop_matcher_find():
    m = StopStringMatcher(("\n\nUser:", "###", "##"))
    assert m.find("no stop here") is None
    assert m.find("answer ### more") == (7, "##")  # same start: the shorter completed first
    assert m.find("a\n\nUser: b ##") == (1, "\n\nUser:")
    assert StopStringMatcher(()).find("anything") is None


def test_stop_matcher_safe_prefix_len():
    m = StopStringMatcher(("\n\nUser:", "END"))
    assert m.safe_prefix_len("Hello") == 5
    assert m.safe_prefix_len("Hello\n") == 5  # "\n" could become "\n\nUser:"
    assert m.safe_prefix_len("Hello\n\nUs") == 5
    assert m.safe_prefix_len("Hello\n\nUx") == 9
    assert m.safe_prefix_len("The EN") == 4
    assert m.safe_prefix_len("The END and more") == 4  # a complete match: cut there
    assert m.safe_prefix_len("") == 0
    assert StopStringMatcher(()).safe_prefix_len("abc\n") == 4


def run_stream_with_stops(tokenizer, ids: list[int], stops: tuple[str, ...]):
    """What a server does: detokenize, cut at a stop, stream only the safe prefix."""
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stops)
    streamed: list[str] = []
    for token in ids:
        text = detok.add([token])
        match = matcher.find(text)
        if match is not None:
            streamed.append(text[: match[0]])
            return streamed, match[1]
        streamed.append(text[: matcher.safe_prefix_len(text)])
    return streamed, None


def test_stop_string_across_token_boundaries(smollm_tokenizer):
    tok = smollm_tokenizer
    text = "The capital of France is Paris.\n\nUser: and Spain?"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "\n\nUser:"
    # The stop string is not a single token: it can only be found on the cumulative text.
    assert all(stop not in tok.decode([i]) for i in ids)
    streamed, matched = run_stream_with_stops(tok, ids, (stop, "never"))
    assert matched == stop
    assert streamed[-1] == "The capital of France is Paris."
    # Streaming never showed a character that was later taken back.
    for earlier, later in zip(streamed, streamed[1:], strict=False):
        assert later.startswith(earlier)
    assert not any("\n" in s for s in streamed)


def test_partial_stop_prefix_is_released_when_it_does_not_match(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("Stage 1: END OF PART one. Done", add_special_tokens=False)
    streamed, matched = run_stream_with_stops(tok, ids, ("END.",))
    assert matched is None
    assert streamed[-1] == "Stage 1: END OF PART one. Done"
    # While "END" could still have become "END." it was held back.
    assert any(s.endswith("Stage 1: ") for s in streamed)
