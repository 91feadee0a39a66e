"""IncrementalDetokenizer: the same text as one full decode, from short windows only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroom.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = ["plain ascii text", "naïve café", "日本語のテキスト", "emoji 🙂👍🏽 mix", "Ωμέγα"]


class ByteTokens:
    """Tokens are chunks of UTF-8 bytes, so a character can straddle tokens."""

    def __init__(self, text: str, cuts: list[int]) -> None:
        data = text.encode()
        bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
        self.chunks = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        self.windows: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.windows.append(len(ids))
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


def stream(tokens: ByteTokens) -> list[str]:
    detok = IncrementalDetokenizer(tokens.decode)
    ids = list(range(len(tokens.chunks)))
    return [detok.update(ids[: n + 1], finished=n + 1 == len(ids)) for n in range(len(ids))]


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 200), max_size=30))
def test_streamed_text_equals_the_full_decode(text: str, cuts: list[int]) -> None:
    tokens = ByteTokens(text, cuts)
    texts = stream(tokens)
    assert texts[-1] == text
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before)  # text only grows
    assert not any(t.endswith(REPLACEMENT_CHAR) for t in texts[:-1])


@pytest.mark.parametrize("text", TEXTS)
def test_one_byte_tokens_never_show_half_a_character(text: str) -> None:
    tokens = ByteTokens(text, list(range(len(text.encode()))))
    texts = stream(tokens)
    assert texts[-1] == text
    assert all(REPLACEMENT_CHAR not in t for t in texts)


def test_each_step_decodes_a_short_window() -> None:
    tokens = ByteTokens("a long output " * 100, list(range(0, 1400, 2)))
    assert stream(tokens)[-1] == "a long output " * 100
    assert max(tokens.windows) <= 4  # never the whole output


def test_a_finished_output_keeps_a_trailing_incomplete_character() -> None:
    tokens = ByteTokens("ok", [])
    tokens.chunks.append("é".encode()[:1])
    detok = IncrementalDetokenizer(tokens.decode)
    assert detok.update([0]) == "ok"
    assert detok.update([0, 1]) == "ok"  # held: the next token may complete the character
    assert detok.update([0, 1], finished=True) == "ok\ufffd"  # flushed at the end


def test_real_byte_level_bpe_round_trips() -> None:
    """A byte-level BPE trained here (the SmolLM2/GPT-2 family of tokenizers)."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 20, vocab_size=300, min_frequency=1, show_progress=False)
    text = " ".join(TEXTS) + " unseen: Ж🙃"
    ids = bpe.encode(text).ids
    detok = IncrementalDetokenizer(bpe.decode)
    texts = [detok.update(ids[: n + 1], finished=n + 1 == len(ids)) for n in range(len(ids))]
    assert texts[-1] == bpe.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in t for t in texts)
