"""The engine loop on a real pair whose target computes a token alike in any pass (the 0.5B at fp32, drafted for
by its own int4 graph), offline: exact decoding equals plain decoding token for token. FLy's loosening and its
guards, which need a drafter that disagrees with the target, are tested in test_fly_rules.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fly_runtime import GenerationConfig, InvalidPromptError
from tests.integration.conftest import PROMPTS, greedy_runs


TOKENS = 48


@pytest.fixture(scope="module")
def engine(exact_engine):
    return exact_engine


@pytest.fixture(scope="module")
def runs(engine, chat_ids):
    """ar / exact / fly greedy runs of every prompt, shared by the tests below."""
    return greedy_runs(engine, chat_ids, PROMPTS[:4], {
        "ar": GenerationConfig(mode="ar", max_new_tokens=TOKENS),
        "exact": GenerationConfig(mode="exact", max_new_tokens=TOKENS),
        "exact-no-ngram": GenerationConfig(mode="exact", ngram=False, max_new_tokens=TOKENS),
        "fly": GenerationConfig(mode="fly", max_new_tokens=TOKENS)})


def test_exact_is_token_identical_to_ar(runs):
    for i, (ar, exact) in enumerate(zip(runs["ar"], runs["exact"])):
        assert exact.token_ids == ar.token_ids, f"prompt {i}: {PROMPTS[i]!r}"
        assert exact.text == ar.text
    for ar, exact in zip(runs["ar"], runs["exact-no-ngram"]):
        assert exact.token_ids == ar.token_ids


def test_ar_takes_one_forward_per_token(runs):
    for ar in runs["ar"]:
        eos = 1 if ar.finish_reason == "stop" else 0  # the forward that produced EOS yields no token
        assert ar.stats.target_forwards == ar.stats.new_tokens + eos


def test_stats_are_consistent(runs):
    for r in runs["exact"] + runs["fly"]:
        s = r.stats
        assert s.new_tokens == len(r.token_ids) <= TOKENS
        assert s.native_accepted + s.fly_forgiven <= s.drafted_tokens
        assert 0 <= s.acceptance_rate <= 1
        assert s.tokens_per_second > 0 and s.seconds > 0
        assert s.drafter_forwards > 0


def test_max_new_tokens_and_eos(engine, chat_ids, runs):
    long = runs["ar"][0]
    assert long.finish_reason == "length" and long.stats.new_tokens == TOKENS
    short = engine.generate(chat_ids("Reply with the single word: yes"), GenerationConfig(max_new_tokens=20))
    assert short.finish_reason == "stop"
    assert short.stats.new_tokens < 20
    assert "<|im_end|>" not in short.text and not set(short.token_ids) & engine.eos_token_ids


@pytest.mark.parametrize("mode", ["ar", "exact", "fly"])
def test_multi_token_stop_string(engine, chat_ids, runs, mode):
    reference = runs[mode][0]
    if mode == "fly":  # adaptive FLy output depends on the (timed) schedule; a fixed K repeats exactly
        reference = engine.generate(chat_ids(PROMPTS[0]), GenerationConfig(mode=mode, k=8, max_new_tokens=TOKENS))
    text = reference.text
    # a stop string of several tokens from the middle of the reply
    start = len(text) // 2
    stop = text[start : start + 12]
    assert len(engine.tokenizer.encode(stop)) > 1
    cut = text.index(stop)
    k = 8 if mode == "fly" else None
    stream = engine.stream(chat_ids(PROMPTS[0]), GenerationConfig(mode=mode, k=k, max_new_tokens=TOKENS, stop=(stop,)))
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == text[:cut]
    assert stream.result.finish_reason == "stop"
    assert len(stream.result.token_ids) < len(reference.token_ids)


def test_streamed_pieces_never_split_characters(engine, chat_ids):
    stream = engine.stream(chat_ids("Write the Japanese word for cat, then two emoji of cats."),
                           GenerationConfig(max_new_tokens=30))
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert all("\ufffd" not in p for p in pieces)
    assert any(ord(c) > 0x3000 for c in stream.result.text)


def test_sampling_is_seeded_and_reproducible(engine, chat_ids):
    ids = chat_ids(PROMPTS[6])
    for mode in ("exact", "fly"):
        a = engine.generate(ids, GenerationConfig(mode=mode, temperature=0.9, seed=11, max_new_tokens=24))
        b = engine.generate(ids, GenerationConfig(mode=mode, temperature=0.9, seed=11, max_new_tokens=24))
        assert a.token_ids == b.token_ids
    others = {tuple(engine.generate(ids, GenerationConfig(mode="fly", temperature=1.0, seed=s,
                                                          max_new_tokens=24)).token_ids) for s in range(3)}
    assert len(others) > 1


def test_bad_prompt_errors_then_engine_still_works(engine, chat_ids, runs):
    with pytest.raises(InvalidPromptError, match="empty"):
        engine.stream([], GenerationConfig())
    with pytest.raises(InvalidPromptError, match=r"context window \(\d+ tokens\)"):
        engine.stream([1] * 10, GenerationConfig(max_new_tokens=engine.max_context))
    again = engine.generate(chat_ids(PROMPTS[1]), GenerationConfig(mode="exact", max_new_tokens=TOKENS))
    assert again.token_ids == runs["ar"][1].token_ids


def test_abandoned_stream_frees_the_engine(engine, chat_ids, runs):
    stream = engine.stream(chat_ids(PROMPTS[2]), GenerationConfig(mode="fly", max_new_tokens=TOKENS))
    for _ in range(3):
        next(stream)
    stream.close()
    after = engine.generate(chat_ids(PROMPTS[0]), GenerationConfig(mode="exact", max_new_tokens=TOKENS))
    assert after.token_ids == runs["ar"][0].token_ids


def test_a_follow_up_turn_reads_only_what_the_last_request_left_uncached(engine):
    def encode(messages: list[dict]) -> list[int]:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    config = GenerationConfig(mode="exact", max_new_tokens=24)
    turn = [{"role": "user", "content": PROMPTS[4]}]
    engine.clear_cache()
    first = engine.generate(encode(turn), config)
    assert first.stats.cached_tokens == 0
    follow_up = encode(turn + [{"role": "assistant", "content": first.text},
                               {"role": "user", "content": "Now multiply the result by 2."}])
    warm = engine.generate(follow_up, config)
    # the first prompt and its answer (as far as re-tokenising the text gives the same ids) come from the cache
    assert len(encode(turn)) < warm.stats.cached_tokens < len(follow_up)
    engine.clear_cache()
    cold = engine.generate(follow_up, GenerationConfig(mode="ar", max_new_tokens=24))
    assert cold.stats.cached_tokens == 0 and cold.token_ids == warm.token_ids


def test_drafter_catches_up_before_drafting_and_requests_start_fresh(engine, chat_ids):
    from fly_runtime.drafters import DraftShape
    from fly_runtime.sampling import Sampler

    prompt = chat_ids(PROMPTS[5])
    drafter = engine.drafter
    with engine.exclusive():
        drafter.reset(cache=True)
        assert drafter.commit(prompt[:10]) == 9  # what reading it would take
        drafter.commit(prompt[:10], read=True)
        assert drafter.sequence.ids == prompt[:9]
        assert drafter.commit(prompt) == len(prompt) - 10
        drafter.commit(prompt, read=True)  # reads only what it has not read
        assert drafter.sequence.ids == prompt[:-1] and drafter.commit(prompt) == 0
        draft = drafter.propose(prompt, DraftShape(k=4, confidence_floor=0.0, extension=0, ngrams=True),
                                Sampler(0.0, 0, 1.0, torch.Generator()))
        assert len(draft.token_ids) == 4 and draft.forwards >= 1
        assert drafter.sequence.ids[: len(prompt)] == prompt  # only the last prompt id was fed with the draft
        assert drafter._ngram_proposed > 0  # the round asked for n-grams: the cascade checked them
    # the drafter forgets the request, the n-gram gate included
    assert len(drafter.sequence) == 0 and drafter._ngram_proposed == 0


def test_a_lone_doubtful_draft_token_is_dropped_in_exact_mode_but_not_in_fly(engine, chat_ids):
    from fly_runtime.drafters import DraftShape
    from fly_runtime.sampling import Sampler

    prompt = chat_ids(PROMPTS[1])
    drafter = engine.drafter
    greedy = Sampler(0.0, 0, 1.0, torch.Generator())
    with engine.exclusive():
        drafter.commit(prompt, read=True)
        # every token is doubtful under a floor of 1: exact drops the draft (a plain step costs less than
        # verifying one doubtful token); FLy drafts on past its first doubt (a mismatch there may be
        # forgiven) and stops at the second
        dropped = drafter.propose(prompt, DraftShape(k=8, confidence_floor=1.0, extension=0), greedy)
        assert dropped.token_ids == [] and dropped.forwards == 1
        drafter.commit(prompt)
        windowed = drafter.propose(prompt, DraftShape(k=8, confidence_floor=1.0, extension=3), greedy)
        assert len(windowed.token_ids) == 2 and windowed.forwards == 2
    # the engine stays exact when drafts are dropped: exact output still equals ar
    config = dict(max_new_tokens=24)
    assert engine.generate(prompt, GenerationConfig(mode="exact", **config)).token_ids == \
        engine.generate(prompt, GenerationConfig(mode="ar", **config)).token_ids


def test_short_answer_to_a_long_prompt_spares_the_drafter_its_read(engine, chat_ids):
    # a long document and a question answered in a few tokens: reading the document would cost the drafter
    # far more than drafting could save, so an adaptive request drafts by prompt lookup alone
    lines = [f"order {i}: customer {i % 7} bought {i * 3 % 11} boxes of item {i * 5 % 13}" for i in range(60)]
    document = "\n".join(lines)
    ids = chat_ids(f"{document}\n\nCopy the line for order 42 exactly.")
    assert len(ids) > 1000
    ar = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=12))
    exact = engine.generate(ids, GenerationConfig(mode="exact", max_new_tokens=12))
    assert exact.token_ids == ar.token_ids
    assert exact.stats.drafter_forwards == 0 and exact.stats.lookup_rounds > 0
    assert exact.stats.target_forwards < ar.stats.target_forwards  # the copied line came from lookup
    # a fixed K keeps the fixed schedule: the drafter reads the prompt and drafts from the first round
    fixed = engine.generate(ids, GenerationConfig(mode="exact", k=4, max_new_tokens=12))
    assert fixed.token_ids == ar.token_ids and fixed.stats.drafter_forwards > 0 and fixed.stats.lookup_rounds == 0


def test_a_short_prompt_is_read_by_the_drafter_at_once(engine, chat_ids, runs):
    # reading a short prompt costs the drafter less than a plain step: renting first (plain steps, lookup
    # rounds) would only delay drafting. `runs` has measured the plain step the price is compared with.
    ids = chat_ids(PROMPTS[1])
    exact = engine.generate(ids, GenerationConfig(mode="exact", max_new_tokens=24))
    assert exact.stats.lookup_rounds == 0 and exact.stats.drafter_forwards > 0
    assert exact.stats.plain_steps <= 1  # the budget's last token, if one remains alone, is decoded plainly
    assert exact.token_ids == engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=24)).token_ids


def test_torch_keeps_off_onnx_runtimes_cores_while_generating_and_the_setting_is_restored(engine, chat_ids):
    assert engine.host_threads == 1  # the default pair runs on ONNX Runtime
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stream = engine.stream(chat_ids(PROMPTS[0]), GenerationConfig(mode="exact", max_new_tokens=8))
        next(stream)
        during = torch.get_num_threads()
        stream.close()
        assert during == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)


def test_cli_generate_json_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fly_runtime.cli", "generate", "--json", "--max-new-tokens", "16",
         "Write a Python function that adds two numbers."],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "stats"}
    assert out["text"] and 0 < len(out["token_ids"]) <= 16
    assert set(out["stats"]) >= {"new_tokens", "target_forwards", "mean_accepted", "acceptance_rate",
                                 "fly_forgiven", "seconds", "tokens_per_second"}
    assert out["stats"]["new_tokens"] == len(out["token_ids"])


def test_cli_rejects_bad_settings_before_loading_models():
    proc = subprocess.run([sys.executable, "-m", "fly_runtime.cli", "generate", "--k", "0", "--mode", "exact", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "k (drafts per round) must be >= 1" in proc.stderr
