"""Batched decoding without a model: a small arithmetic language model whose cache holds several sequences,
driven by the real engine, slots and shared passes from several threads at once."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fly_runtime import GenerationConfig
from fly_runtime.backends.base import CachedSequence
from fly_runtime.batching import SharedPasses
from fly_runtime.engine import FlyEngine


class ArithmeticLM:
    """Next-token logits that depend on a sequence's whole cached history (a running hash), so a row computed
    against the wrong sequence's cells, a missing cell or a misplaced position changes the text."""

    def __init__(self, vocab: int, sequences: int = 4, max_context: int = 4096, fail_on: int | None = None) -> None:
        self.vocab, self.sequences, self.max_context = vocab, sequences, max_context
        self.name = "arithmetic"
        self.cells: dict[int, list[int]] = {s: [] for s in range(sequences)}
        self.passes: list[int] = []  # parts per pass
        self.fail_on = fail_on  # a token id whose pass raises (a failing request)
        self.before_pass = lambda: None  # a test's hook, run before every pass

    def _logits(self, history: list[int]) -> torch.Tensor:
        state = 17
        for position, token in enumerate(history):
            state = (state * 31 + token * 7 + position) % 1_000_003
        logits = torch.zeros(self.vocab)
        logits[state % self.vocab] = 5.0
        return logits

    def forward_rows(self, parts):
        self.before_pass()
        self.passes.append(len(parts))
        if self.fail_on is not None and any(self.fail_on in ids for _, ids, _ in parts):
            raise RuntimeError("the pass failed")
        out = []
        for seq, ids, keep in parts:
            rows = []
            for token in ids:
                self.cells[seq].append(token)
                rows.append(self._logits(self.cells[seq]))
            out.append(torch.stack(rows[-(keep or len(ids)):]))
        return out

    def crop_sequence(self, seq: int, length: int) -> None:
        del self.cells[seq][length:]

    def share(self, source: int, target: int, length: int) -> None:
        self.cells[target] = self.cells[source][:length]

    def forward(self, ids, keep=None):
        return self.forward_rows([(0, ids, keep)])[0]

    def crop(self, length: int) -> None:
        self.crop_sequence(0, length)


def engine_over(backend, tokenizer) -> FlyEngine:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return FlyEngine(CachedSequence(backend), tokenizer, None, vocab_size=backend.vocab, eos_token_ids=[eos],
                     max_context=backend.max_context)


PROMPTS = [[5, 6, 7, 8, 9, 10 + n, 11 + n, 12 + n] for n in range(6)]
CONFIG = GenerationConfig(mode="ar", max_new_tokens=24)


def test_requests_at_once_share_passes_and_answer_as_served_alone(tokenizer):
    one_by_one = engine_over(ArithmeticLM(len(tokenizer), sequences=1), tokenizer)
    alone = [one_by_one.generate(p, CONFIG).token_ids for p in PROMPTS]
    lm = ArithmeticLM(len(tokenizer), sequences=4)
    engine = engine_over(lm, tokenizer)
    engine.slots.passes.window = 5.0  # each pass waits for every running request: the batching is certain
    # a pass takes 20 ms, as a real one does: the first request cannot finish before the others have started
    lm.before_pass = lambda: time.sleep(0.02)
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: engine.generate(p, CONFIG), PROMPTS))
    assert [r.token_ids for r in together] == alone
    assert max(lm.passes) == 4  # four requests decoded in one pass; the other two waited for a sequence
    assert len(lm.passes) < sum(r.stats.target_forwards for r in together)


def test_a_request_starts_from_a_prefix_another_sequence_holds(tokenizer):
    lm = ArithmeticLM(len(tokenizer), sequences=2)
    engine = engine_over(lm, tokenizer)
    system = list(range(20, 60))
    engine.generate(system + [1, 2], CONFIG)
    hold = engine.stream(system + [3, 4], CONFIG)  # takes the sequence that holds the system prompt, and keeps it
    next(hold)
    shared = engine.generate(system + [5], CONFIG)  # on the other sequence, from the busy one's cells
    assert shared.stats.cached_tokens == len(system)
    hold.close()
    alone = engine_over(ArithmeticLM(len(tokenizer), sequences=1), tokenizer)
    assert shared.token_ids == alone.generate(system + [5], CONFIG).token_ids


def test_a_failing_request_fails_alone(tokenizer):
    lm = ArithmeticLM(len(tokenizer), sequences=3, fail_on=99)
    engine = engine_over(lm, tokenizer)
    engine.slots.passes.window = 5.0
    prompts = [PROMPTS[0], [5, 6, 99], PROMPTS[1]]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(engine.generate, p, CONFIG) for p in prompts]
    with pytest.raises(RuntimeError, match="the pass failed"):
        futures[1].result()
    alone = engine_over(ArithmeticLM(len(tokenizer), sequences=1), tokenizer)
    for i in (0, 2):
        assert futures[i].result().token_ids == alone.generate(prompts[i], CONFIG).token_ids
    assert engine.generate(PROMPTS[2], CONFIG).finish_reason in ("stop", "length")  # still serving


def test_a_stream_left_open_does_not_hold_up_the_others(tokenizer):
    lm = ArithmeticLM(len(tokenizer), sequences=2)
    engine = engine_over(lm, tokenizer)
    engine.slots.passes.window = 0.05
    idle = engine.stream(PROMPTS[0], CONFIG)
    next(idle)  # the caller stops reading: its request holds a sequence but asks for no pass
    done = engine.generate(PROMPTS[1], CONFIG)  # waits out the window each pass, then runs alone
    assert done.finish_reason in ("stop", "length")
    idle.close()
    assert engine.slots.holding() is False


def test_a_request_that_finds_the_drafter_busy_is_decoded_plainly_and_says_so(tokenizer):
    from fly_runtime.drafters import NgramDrafter

    lm = ArithmeticLM(len(tokenizer), sequences=2)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = FlyEngine(CachedSequence(lm), tokenizer, NgramDrafter(), vocab_size=lm.vocab, eos_token_ids=[eos],
                       max_context=lm.max_context)
    engine.slots.passes.window = 0.05
    exact = GenerationConfig(mode="exact", max_new_tokens=24)
    drafting = engine.stream(PROMPTS[0], exact)
    next(drafting)  # this request holds the drafter while its stream is open
    second = engine.generate(PROMPTS[1], exact)
    assert second.stats.drafter_busy == 1
    assert second.token_ids == engine.generate(PROMPTS[1], CONFIG).token_ids  # plain decoding's answer
    drafting.close()
    alone = engine.generate(PROMPTS[1], exact)
    assert alone.stats.drafter_busy == 0


def test_the_cache_budget_admits_requests_that_fit(tokenizer):
    lm = ArithmeticLM(len(tokenizer), sequences=2, max_context=100)
    engine = engine_over(lm, tokenizer)
    config = GenerationConfig(mode="ar", max_new_tokens=40)
    first = engine.stream(PROMPTS[0], config)
    next(first)  # holds 8 + 40 + 16 cells of 100
    started = threading.Event()

    def second() -> None:
        started.set()
        engine.generate(PROMPTS[1], config)

    waiter = threading.Thread(target=second)
    waiter.start()
    started.wait()
    waiter.join(0.3)
    assert waiter.is_alive()  # 64 + 64 > 100: it waits for the first to finish
    first.close()
    waiter.join(10)
    assert not waiter.is_alive()


def test_shared_passes_wait_for_every_running_caller():
    lm = ArithmeticLM(16, sequences=3)
    passes = SharedPasses(lm, window=5.0)
    for _ in range(3):
        passes.join()
    results: dict[int, list[int]] = {}

    def decode(seq: int) -> None:
        token, out = seq + 1, []
        for _ in range(5):
            token = int(passes.forward(seq, [token], 1)[0].argmax())
            out.append(token)
        results[seq] = out
        passes.leave()

    threads = [threading.Thread(target=decode, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert lm.passes == [3] * 5
    single = ArithmeticLM(16, sequences=1)
    for seq in range(3):
        token, expected = seq + 1, []
        single.cells[0] = []
        for _ in range(5):
            token = int(single.forward([token], 1)[0].argmax())
            expected.append(token)
        assert results[seq] == expected


def test_interleaved_conversations_each_read_only_their_new_tokens(tokenizer):
    lm = ArithmeticLM(len(tokenizer), sequences=2)
    engine = engine_over(lm, tokenizer)
    system = list(range(20, 80))  # an agent's instructions and tools, the same in both conversations
    first = {name: system + [opening] for name, opening in (("a", 1), ("b", 2))}
    answers = {name: engine.generate(prompt, CONFIG) for name, prompt in first.items()}  # a, then b
    assert answers["b"].stats.cached_tokens == len(system)  # b read the shared instructions from a's cells
    for name in ("a", "b"):
        history = first[name] + answers[name].token_ids
        follow_up = engine.generate(history + [3, 4], CONFIG)
        assert follow_up.stats.cached_tokens >= len(history) - 1  # all but the reply's last token, never fed


class TimedLM(ArithmeticLM):
    """Passes that cost what ``cost_ms`` says for their number of parts: a machine's row budget, made up."""

    def __init__(self, cost_ms: dict[int, float], sequences: int = 8) -> None:
        super().__init__(16, sequences=sequences)
        self.cost_ms = cost_ms

    def forward_rows(self, parts):
        import time

        time.sleep(self.cost_ms.get(len(parts), 0) / 1000)
        return super().forward_rows(parts)


def test_the_batch_size_is_the_smallest_near_the_best_throughput_and_is_kept(cache):
    from types import SimpleNamespace

    from fly_runtime.tuning import choose_batch

    model = SimpleNamespace(key="k", name="made-up")
    lm = TimedLM({1: 20, 2: 21, 4: 80, 8: 160})  # two rows for the price of one; beyond, no gain
    assert choose_batch(lm, model, context=8, repeats=2) == 2
    assert all(len(cells) == 0 for cells in lm.cells.values())  # measured, then emptied
    passes = len(lm.passes)
    assert choose_batch(lm, model) == 2 and len(lm.passes) == passes  # recorded: not measured again
    assert choose_batch(TimedLM({1: 20, 2: 22, 4: 24, 8: 30}), SimpleNamespace(key="j", name="m"), 8, 2) == 8
    # a target that holds more sequences than the record timed is measured again
    wider = TimedLM({1: 20, 2: 21, 4: 80, 8: 160, 16: 40}, sequences=16)
    assert choose_batch(wider, model, context=8, repeats=2) == 16 and wider.passes


def test_llama_cpp_work_runs_on_the_process_s_one_thread_whoever_asks():
    """llama.cpp and torch share one OpenMP runtime: every thread that starts parallel work gets a team, and more team
    threads than cores slow every llama.cpp step after. So all of it (any backend's passes, the prompt reader's
    products, the bench's peer) runs on one thread, and work already there runs in place instead of waiting on
    itself."""
    from fly_runtime.backends.openmp_thread import on_openmp_thread

    def work() -> tuple[int, int]:
        return threading.get_ident(), on_openmp_thread(threading.get_ident)  # nested: no deadlock

    with ThreadPoolExecutor(max_workers=4) as callers:
        ran = list(callers.map(lambda _: on_openmp_thread(work), range(8)))
    assert len(set(ran)) == 1
    outer, inner = ran[0]
    assert outer == inner != threading.get_ident()
