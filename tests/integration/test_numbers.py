"""Number tokens FLy never forgives, found on the default pair's tokenizer."""

import pytest

from fly_runtime import ModelSettings
from fly_runtime.loader import load_tokenizer
from fly_runtime.numbers import digit_token_mask
from fly_runtime.sources.resolve import resolve_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(ModelSettings().target))


@pytest.fixture(scope="module")
def mask(tokenizer):
    return digit_token_mask(tokenizer, len(tokenizer))


def single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens in this tokenizer"
    return ids[0]


def test_every_digit_of_a_text_lies_in_a_protected_token(tokenizer, mask):
    for text in ("Total: 1,234.5 cups", "x² = ７", "pi is 3.14159, e is 2.718"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        protected = "".join(tokenizer.decode([i]) for i in ids if mask[i])
        unprotected = "".join(tokenizer.decode([i]) for i in ids if not mask[i])
        assert [c for c in protected if c.isdigit()] == [c for c in text if c.isdigit()]
        assert not any(c.isdigit() for c in unprotected)


def test_words_punctuation_and_special_tokens_are_not(tokenizer, mask):
    for text in (" per", " each", ":\n", " \\(", "So"):
        assert not mask[single_token(tokenizer, text)]
    assert not mask[tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert mask.shape == (len(tokenizer),)
    # a small share of the vocabulary: FLy still forgives everything else
    assert 10 <= int(mask.sum()) < len(tokenizer) // 100


def test_the_fast_tokenizers_own_decode_marks_what_batch_decode_does(tokenizer, mask):
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
    assert mask.tolist() == [any(c.isdigit() for c in text) for text in texts]
