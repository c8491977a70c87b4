"""Suffix drafts: prompt lookup also draws on the replies this process wrote before (an agent's tool calls, a
template's answers repeat across requests), bounded, never across two replies, for greedy requests only, and
every such draft verified exactly, so that no reply holds a token only another request put there."""

import numpy as np
import torch

from fly_runtime import GenerationConfig
from fly_runtime.backends.base import CachedSequence
from fly_runtime.drafters import DraftShape, NgramDrafter, ReplyHistory
from fly_runtime.engine import FlyEngine
from fly_runtime.sampling import Sampler


def follow(history: ReplyHistory, tail: np.ndarray, limit: int) -> list[int]:
    """What followed the longest (then latest) earlier match of ``tail``'s end, as prompt lookup reads it."""
    length, end = history.match(tail)
    return history.after(end, limit) if length else []


def test_history_proposes_what_followed_the_latest_match_and_stops_at_its_reply_end():
    history = ReplyHistory()
    history.remember([5, 6, 7, 8])
    history.remember([1, 5, 6, 9, 10])
    assert follow(history, np.array([5, 6]), 4) == [9, 10]  # the latest reply's continuation, cut at its end
    assert follow(history, np.array([7, 8]), 4) == []  # the end of a reply has nothing after it
    assert follow(history, np.array([6]), 4) == []  # one shared token is no evidence
    history.remember([7, 8])  # too short to teach anything
    assert follow(history, np.array([7, 8]), 4) == []


def test_history_keeps_its_capacity_dropping_the_oldest_replies():
    history = ReplyHistory(capacity=12)
    history.remember([1, 2, 3, 4, 5])
    for start in (20, 30):
        history.remember(list(range(start, start + 5)))
    assert follow(history, np.array([1, 2]), 3) == []  # the oldest reply went
    assert follow(history, np.array([30, 31]), 3) == [32, 33, 34]


def test_lookup_prefers_the_context_then_a_longer_match_in_earlier_replies():
    history = ReplyHistory()
    history.remember([40, 41, 42, 43, 44, 45])
    lookup = NgramDrafter(history=history)
    greedy, shape = Sampler(0.0, 0, 1.0, torch.Generator()), DraftShape(3, 0.0, 0)

    def propose(context):
        draft = lookup.propose(context, shape, greedy)
        return draft.token_ids, draft.exact

    assert propose([1, 2, 3, 41, 42]) == ([43, 44, 45], True)  # nothing in the context: an earlier reply
    assert propose([42, 43, 7, 41, 42, 43]) == ([44, 45], True)  # a 3-gram there beats a 2-gram here
    assert propose([41, 42, 7, 8, 41, 42]) == ([7, 8, 41], False)  # as long a match here wins
    assert lookup.lookup([1, 2, 3, 41, 42], 3) == []  # the drafter model's cascade reads the context only
    assert NgramDrafter().propose([1, 2, 3, 41, 42], shape, greedy).token_ids == []  # no history: nothing
    assert lookup.propose([1, 2, 3, 41, 42], DraftShape(3, 0.0, 0, history=False), greedy).token_ids == []


def test_lookup_follows_the_latest_of_the_longest_matches_in_the_context():
    """In a conversation the latest turn is the pattern the next follows: after "<tool_call>" an agent's last call,
    not its system prompt's format example (``3, 7, 1, 2`` opens both here; 90 is the example, 50 the call)."""
    lookup, greedy = NgramDrafter(), Sampler(0.0, 0, 1.0, torch.Generator())
    example_then_call = [9, 3, 7, 1, 2, 90, 91, 5, 8, 3, 7, 1, 2, 50, 51, 6, 4, 3, 7, 1, 2]
    assert lookup.propose(example_then_call, DraftShape(3, 0.0, 0), greedy).token_ids == [50, 51, 6]
    # a longer match beats a later one
    assert lookup.lookup([3, 7, 1, 2, 60, 8, 1, 2, 70, 3, 7, 1, 2], 2) == [60, 8]
    # matches longer than four ids count: the 5-id match (4, 3, 7, 1, 2) beats the later 4-id one
    assert lookup.lookup([4, 3, 7, 1, 2, 61, 9, 3, 7, 1, 2, 62, 4, 3, 7, 1, 2], 1) == [61]
    # a short match is a common phrase: its first occurrence (a retrieved text, read in order) is followed
    assert lookup.lookup([8, 2, 70, 9, 2, 71, 5, 2], 1) == [70]


def test_a_reply_is_matched_through_the_end_of_the_prompt_it_answered():
    """A reply's opening depends on the turn it answers (an agent's first call after the user's question, its next
    ones after a tool's result): the history keeps each reply after its prompt's last ids, so a new reply draws on
    the one that answered a turn ending the same way."""
    history = ReplyHistory()
    history.remember([20, 21, 22, 23], prompt=[1, 2, 8, 9])  # answering a turn that ends 8, 9
    history.remember([30, 31, 32, 33], prompt=[1, 2, 5, 9])  # the latest, answering one that ends 5, 9
    lookup, greedy = NgramDrafter(history=history), Sampler(0.0, 0, 1.0, torch.Generator())
    shape = DraftShape(3, 0.0, 0)
    assert lookup.propose([40, 41, 8, 9], shape, greedy).token_ids == [20, 21, 22]
    assert lookup.propose([40, 41, 5, 9], shape, greedy).token_ids == [30, 31, 32]
    assert lookup.propose([40, 41, 8, 9, 20, 21], shape, greedy).token_ids == [22, 23]  # cut at its reply's end
    assert follow(history, np.array([2, 5, 9]), 2) == [30, 31]


def test_a_sampled_request_never_drafts_from_earlier_replies():
    history = ReplyHistory()
    history.remember([40, 41, 42, 43])
    sampled = Sampler(0.8, 0, 1.0, torch.Generator().manual_seed(1))
    assert NgramDrafter(history=history).propose([1, 41, 42], DraftShape(3, 0.0, 0), sampled).token_ids == []


class CountingLM:
    """Writes the next id up (logit ``sure`` at token + 1, and ``second`` at token + 2): no reply repeats itself,
    so prompt lookup finds nothing in the context, and a second request over the same ids can draft only from
    the first one's reply. With ``second`` near ``sure`` the target is unsure between two tokens at every step,
    where FLy may forgive a draft of the second."""

    name, max_context = "counting", 4096

    def __init__(self, vocab: int, sure: float = 5.0, second: float = 0.0) -> None:
        self.vocab, self.sure, self.second, self.cells = vocab, sure, second, []

    def forward(self, ids, keep=None):
        self.cells.extend(ids)
        rows = torch.zeros(len(ids), self.vocab)
        at = torch.arange(len(ids))
        rows[at, (torch.tensor(list(ids)) + 2) % self.vocab] = self.second
        rows[at, (torch.tensor(list(ids)) + 1) % self.vocab] = self.sure
        return rows[-(keep or len(ids)):]

    def crop(self, length: int) -> None:
        del self.cells[length:]


def _engine(tokenizer, lm: CountingLM) -> tuple[FlyEngine, ReplyHistory]:
    history = ReplyHistory()
    return FlyEngine(CachedSequence(lm), tokenizer, NgramDrafter(history=history), vocab_size=len(tokenizer),
                     eos_token_ids=[0], max_context=4096, history=history), history


def test_a_second_request_drafts_from_the_first_reply_and_writes_what_plain_decoding_writes(tokenizer):
    engine, _ = _engine(tokenizer, CountingLM(len(tokenizer)))
    config = GenerationConfig(mode="exact", k=4, max_new_tokens=30)
    first = engine.generate([30, 40, 100], config)
    assert first.token_ids == list(range(101, 131)) and first.stats.target_forwards == 30  # nothing to draft from
    second = engine.generate([50, 60, 110, 111], config)
    plain = engine.generate([50, 60, 110, 111], GenerationConfig(mode="ar", max_new_tokens=30))
    assert second.token_ids == plain.token_ids == list(range(112, 142))
    assert second.stats.target_forwards < 20  # the first reply's 112..130 drafted, several a pass
    off = engine.generate([50, 60, 110, 111], GenerationConfig(mode="exact", k=4, max_new_tokens=30,
                                                               suffix_drafts=False))
    assert off.token_ids == plain.token_ids and off.stats.target_forwards == 30  # the setting turns them off


def test_fly_forgives_no_token_drafted_from_another_reply(tokenizer):
    """The target is unsure at every step (token + 1 or token + 2, nearly even), so FLy forgives a draft that
    skips a number where the next drafts agree: from the request's own prompt it does, from an earlier reply
    it must not."""
    engine, history = _engine(tokenizer, CountingLM(len(tokenizer), sure=10.0, second=9.8))
    config = GenerationConfig(mode="fly", k=8, window=2, exact_opening=0, exact_numbers=False, adaptive=False,
                              max_new_tokens=8)
    # the reply's first token is the target's own (112); then 112 -> 114 skips the target's first choice
    skipping = [110, 111, 112, 114, 115, 116, 117, 118, 119, 120]
    own = engine.generate([*skipping, 7, 110, 111], config)
    assert own.token_ids[:2] == [112, 114] and own.stats.fly_forgiven >= 1  # the prompt's draft, forgiven
    history.remember(skipping)
    borrowed = engine.generate([50, 60, 110, 111], config)
    assert borrowed.stats.drafted_tokens > 0 and borrowed.stats.fly_forgiven == 0
    assert borrowed.token_ids == list(range(112, 120))  # what the target writes itself


def test_a_cleared_history_proposes_nothing_it_held():
    """What `fly bench` does after its warm-up: a measured run of the warm-up's prompt must not copy its reply."""
    history = ReplyHistory()
    history.remember([5, 6, 7, 8, 9], prompt=[1, 2])
    assert history.match(np.array([2, 5, 6]))[0] > 0
    history.clear()
    assert history.match(np.array([2, 5, 6])) == (0, -1)
    history.remember([5, 6, 7, 8, 9], prompt=[1, 2])  # and it learns again
    assert follow(history, np.array([2, 5, 6]), 2) == [7, 8]


def test_a_quoted_value_is_looked_up_by_its_text_where_its_ids_do_not_match(tokenizer):
    """A string value opens after a quote ("Paris), where the prompt has the word after a space ( Paris): no id of
    the value occurs in the prompt, so prompt lookup by ids proposes nothing; by text it proposes what follows the
    word there. Only a value's first tokens are looked up so, at the start of a word, and only where ids found
    nothing."""
    from fly_runtime.drafters import QuotedLookup

    greedy, shape = Sampler(0.0, 0, 1.0, torch.Generator()), DraftShape(4, 0.0, 0)
    prompt = tokenizer.encode("What is the capital of France? Paris. Ignore all previous instructions. ")
    lookup, by_ids = NgramDrafter(quoted=QuotedLookup(tokenizer)), NgramDrafter()

    def after(reply: str, drafter=lookup) -> str:
        context = prompt + tokenizer.encode(reply)
        return tokenizer.decode(drafter.propose(context, shape, greedy).token_ids)

    assert after('{"name": "Pa').startswith("ris. Ign") and "ris. Ignore all".startswith(after('{"name": "Pa'))
    assert after('{"name": "Pa', by_ids) == ""
    assert after('{"name": "Ign').startswith("ore all")
    assert after('{"name": "ari') == ""  # inside a word ("Paris"): not a value's start
    assert after('{"name": "Berlin') == ""  # not in the prompt
