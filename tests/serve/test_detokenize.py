"""Incremental detokenisation against the tokenizer's own decoding of the whole output (smollm2-135m's
tokenizer, shipped with its weights): the same text, from short windows."""

from __future__ import annotations

import random

import pytest

from tessera.serve.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tessera.capture.models import resolve_model
    from tessera.capture.pretrained import weights_dir

    return AutoTokenizer.from_pretrained(str(weights_dir(resolve_model("smollm2-135m"))))


class _Counting:
    """A tokenizer whose decode calls are recorded (how many tokens each decodes)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.windows = tokenizer, []

    def decode(self, tokens, **kw):
        self.windows.append(len(tokens))
        return self.tokenizer.decode(tokens, **kw)


def _full(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, clean_up_tokenization_spaces=False)


TEXT = ("Déjà vu , naïve café ! 東京タワー は 333 m .\n  Emoji: 🙂🚀 — «quotes» , end .\n\n"
        "def f(x):\n    return x ** 2  # ok ?")


def test_text_grows_like_the_whole_decoding_from_short_windows(tokenizer):
    counting = _Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    tokens = tokenizer(TEXT).input_ids
    for i, t in enumerate(tokens):
        before = detok.text
        added = detok.add(t)
        assert detok.text == before + added
        assert _full(tokenizer, tokens[: i + 1]).startswith(detok.text)  # never text the whole decoding lacks
    detok.finish()
    assert detok.text == _full(tokenizer, tokens) == TEXT
    assert max(counting.windows) <= 8  # windows, not the whole output (it has len(tokens) tokens)
    assert len(tokens) > 40


def test_random_tokens_and_a_character_cut_at_the_end(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        detok = IncrementalDetokenizer(tokenizer)
        for t in tokens:
            detok.add(t)
        detok.finish()
        assert detok.text == _full(tokenizer, tokens)
    # the first bytes of a 4-byte character: no text until finish() gives the decoder's replacement for them
    emoji = tokenizer("🙂").input_ids
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert detok.finish() == _full(tokenizer, emoji[:-1]) and detok.text.endswith("\ufffd")
    assert detok.finish() == ""  # nothing is left
