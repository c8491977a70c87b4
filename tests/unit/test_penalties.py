"""Repetition, frequency and presence penalties: each row of a verification pass is penalised as a plain step at
its position would be, so exact decoding under penalties stays plain decoding under them."""

import pytest
import torch

from fly_runtime import GenerationConfig, InvalidSettingsError
from fly_runtime.backends.base import CachedSequence
from fly_runtime.drafters import NgramDrafter
from fly_runtime.engine import FlyEngine
from fly_runtime.penalties import Penalties
from fly_runtime.sampling import Sampler


def test_each_row_sees_the_reply_and_the_drafts_before_it():
    config = GenerationConfig(frequency_penalty=0.5, presence_penalty=1.0)
    penalties = Penalties.of(config, prompt=[1, 2], vocab_size=6)
    out = penalties.apply(torch.zeros(3, 6), reply=[3, 3], drafts=[4, 3])
    assert out[0].tolist() == [0, 0, 0, -2.0, 0, 0]  # 3 twice: 2 * 0.5 + 1
    assert out[1].tolist() == [0, 0, 0, -2.0, -1.5, 0]  # and the first draft, 4
    assert out[2].tolist() == [0, 0, 0, -2.5, -1.5, 0]  # the second draft, 3 again (the last draft feeds no row)


def test_repetition_divides_positive_logits_and_multiplies_negative_ones_of_prompt_and_reply_tokens():
    penalties = Penalties.of(GenerationConfig(repetition_penalty=2.0), prompt=[0], vocab_size=4)
    out = penalties.apply(torch.tensor([[4.0, -4.0, 4.0, 4.0]]), reply=[1])
    assert out[0].tolist() == [2.0, -8.0, 4.0, 4.0]


def test_no_penalty_asked_for_costs_nothing():
    assert Penalties.of(GenerationConfig(), [1, 2, 3], 10) is None


@pytest.mark.parametrize("setting", [{"repetition_penalty": 0}, {"frequency_penalty": 3}, {"presence_penalty": -2.5},
                                     {"min_p": 1.0}])
def test_out_of_range_settings_name_themselves(setting):
    with pytest.raises(InvalidSettingsError, match=next(iter(setting))):
        GenerationConfig(**setting)


def test_min_p_drops_tokens_far_below_the_top_one():
    probs = Sampler(temperature=1.0, min_p=0.4).probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])))
    assert probs[2:].tolist() == [0.0, 0.0] and probs[0] / probs[1] == pytest.approx(0.5 / 0.3)


class RepeatLM:
    """Prefers to repeat its last token (logit 5), then the id 100 on (4): penalties decide what it writes."""

    name, max_context = "repeat", 4096

    def __init__(self, vocab: int) -> None:
        self.vocab, self.cells = vocab, []

    def forward(self, ids, keep=None):
        rows = []
        for token in ids:
            self.cells.append(token)
            row = torch.zeros(self.vocab)
            row[token] = 5.0
            row[(token + 100) % 200] = 4.0
            rows.append(row)
        return torch.stack(rows[-(keep or len(ids)):])

    def crop(self, length: int) -> None:
        del self.cells[length:]


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 0.6},
                                     {"repetition_penalty": 1.5}])
def test_exact_decoding_under_penalties_is_plain_decoding_under_them(tokenizer, penalty):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = FlyEngine(CachedSequence(RepeatLM(len(tokenizer))), tokenizer, NgramDrafter(), vocab_size=len(tokenizer),
                       eos_token_ids=[eos], max_context=4096)
    prompt = [20, 21, 22, 23, 20, 21, 22, 23, 20, 21]  # prompt lookup drafts "22 23 20 21 ..."
    plain = engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24))
    assert set(plain.token_ids) == {21}  # unpenalised, it repeats itself
    ar = engine.generate(prompt, GenerationConfig(mode="ar", max_new_tokens=24, **penalty))
    exact = engine.generate(prompt, GenerationConfig(mode="exact", k=4, max_new_tokens=24, **penalty))
    assert ar.token_ids != plain.token_ids and exact.token_ids == ar.token_ids
    assert exact.stats.target_forwards < len(exact.token_ids)  # drafts were verified, several a pass
