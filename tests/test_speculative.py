"""Speculative decoding (docs/ARCHITECTURE.md §3.13) against independent references.

* the allocator's rollback of drafts, against its invariants (engine/kv/invariants.py);
* the verification rule against the numpy oracle (tests/reference.py): the first and the
  second kept token of a drafting row follow the distribution decoding without drafts
  draws from (Pearson's chi-square, as tests/test_sampling.py), greedy rows keep the
  argmax;
* the engine on the embedded model with drafting on: greedy replies equal mlx-lm's own
  generation (tests/reference.py) on an editing prompt where drafts are accepted (the
  counters must show it: the test cannot pass by never drafting), on ordinary prompts, for
  n = 3 samples drafting from each other, at ``max_tokens`` and a stop string that fall
  inside accepted drafts, in an 8-bit pool; no block leaks after a cancel mid-draft.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, EngineConfig, FinalEvent, FinishReason, SamplingParams
from engine.kv.block_table import BlockTable
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants
from engine.runner.sampling import Candidates, Layout, SamplingRow, processed
from engine.runner.verify import verify
from engine.sched.speculation import (
    KEPT_PROMPTS,
    PROBE_EVERY,
    NgramIndex,
    Speculator,
    StepCost,
)
from tests.reference import chat_prompt, collect, greedy_reference, oracle_distribution, wait_until
from tests.test_sampling import assert_counts_follow

# ---- the allocator's rollback -----------------------------------------------------------------


def test_rejected_drafts_are_rolled_back_and_only_committed_blocks_are_cached():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    table = BlockTable(owner="a")
    alloc.append(table, [1, 2, 3, 4, 5, 6])
    alloc.mark_computed(table)
    # last token + 5 drafts: fills block 1 and reaches into a new block 2
    alloc.append(table, [7, 8, 9, 10, 11, 12], provisional=5)
    check_invariants(alloc, [table])
    assert len(table.hashes) == 1, "a block holding drafts was hashed"
    alloc.mark_computed(table)
    assert not alloc.is_cached(table.blocks[1])
    taken = table.blocks[2]
    alloc.settle_drafts(table, 0)  # all rejected: back to 7 tokens
    check_invariants(alloc, [table])
    assert table.tokens == [1, 2, 3, 4, 5, 6, 7] and len(table.blocks) == 2
    assert alloc.refcount(taken) == 0 and not alloc.is_cached(taken)
    assert not alloc.is_cached(table.blocks[1])
    alloc.append(table, [20, 21, 22], provisional=2)
    alloc.mark_computed(table)
    alloc.settle_drafts(table, 1)  # block 1 = [5, 6, 7, 20] full and computed: named now
    check_invariants(alloc, [table])
    assert table.tokens[-3:] == [7, 20, 21] and alloc.is_cached(table.blocks[1])
    alloc.free(table)
    check_invariants(alloc, [])


def test_drafts_into_a_shared_block_copy_it_and_a_rollback_leaves_the_sibling_intact():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    parent = BlockTable(owner="a")
    alloc.append(parent, [1, 2, 3, 4, 5])
    alloc.mark_computed(parent)
    child = alloc.fork(parent)
    result = alloc.append(child, [6, 7, 8, 9], provisional=3)
    assert result.copies, "the shared partial block was not copied before the drafts"
    alloc.mark_computed(child)
    alloc.settle_drafts(child, 2)
    check_invariants(alloc, [parent, child])
    assert parent.tokens == [1, 2, 3, 4, 5] and child.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError):
        alloc.settle_drafts(child, 1)  # nothing provisional left
    alloc.append(child, [10, 11], provisional=1)
    with pytest.raises(ValueError):
        alloc.append(child, [12])  # drafts are settled before the table grows again
    alloc.free(child)  # a cancel mid-draft
    alloc.free(parent)
    check_invariants(alloc, [])


def test_ngram_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    index = NgramIndex()
    index.update(tokens)
    n, at = index.match(tokens)
    assert n == 3 and tokens[at:at + 2] == [7, 8]
    longer = tokens + [4]
    index.update(longer)  # incremental: the old suffix now has a token after it
    n, at = index.match(tokens)
    assert n == 4 and longer[at] == 4  # [8, 1, 2, 3] occurred once, before the 4
    assert index.match([6, 6]) == (0, -1)


# ---- the verification rule against the oracle -------------------------------------------------

DRAWS = 3000
ROW_LOGITS = np.array([
    [3.0, 2.5, 2.0, 1.2, 1.0, 0.3, -0.5, -1.0, -2.0, -3.0],
    [0.5, 2.8, -1.0, 2.2, 1.5, 0.0, 1.9, -2.0, 0.7, -0.3],
    [1.0, -1.0, 2.0, 0.0, 2.5, 1.5, -0.5, 0.2, 1.1, -2.0],
], dtype=np.float32)


def fake_sequence(params: SamplingParams, history: list[int]):
    return SimpleNamespace(request=SimpleNamespace(params=params), tokens=list(history))


def verified(params: SamplingParams, history: list[int], drafts: tuple[int, ...]):
    seqs = [fake_sequence(params, history) for _ in range(DRAWS)]
    logits = mx.array(np.tile(ROW_LOGITS[: len(drafts) + 1], (DRAWS, 1)))
    pending = verify(logits, seqs, [drafts] * DRAWS, key=mx.random.key(2026))
    mx.eval(pending.arrays())
    return pending.read()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.5),
    SamplingParams(temperature=1.3, top_k=4, min_p=0.05, repetition_penalty=0.8),
])
def test_kept_tokens_follow_the_distribution_without_drafts(params):
    history = [1, 4, 6]
    drafts = (0, 1)  # likely under row 0 (so row 1 is reached often), then row 1's favourite
    out = verified(params, history, drafts)
    first = np.bincount([tokens[0] for _, _, _, tokens in out], minlength=10)
    assert_counts_follow(oracle_distribution(ROW_LOGITS[0], params, history), first)
    # given the first kept token was the draft, the second follows row 1's distribution
    # with the draft in the penalty's window
    second = np.bincount([tokens[1] for _, _, _, tokens in out if tokens[0] == drafts[0]],
                         minlength=10)
    assert second.sum() > 500
    assert_counts_follow(oracle_distribution(ROW_LOGITS[1], params, history + [0]), second)
    assert any(m == 2 for _, _, m, _ in out), "no row accepted both drafts"


def test_a_draft_outside_the_kept_set_is_never_accepted():
    params = SamplingParams(temperature=1.0, top_k=3)
    out = verified(params, [], (9,))
    assert all(m == 0 for _, _, m, _ in out)
    first = np.bincount([tokens[0] for _, _, _, tokens in out], minlength=10)
    assert_counts_follow(oracle_distribution(ROW_LOGITS[0], params, []), first)


#: A vocabulary wider than the nucleus's candidates (engine/runner/sampling.py), so that
#: verification on the CPU samples the candidates, with the ten tokens of ROW_LOGITS spread
#: over it and every other token far below them.
WIDE_VOCAB = 3000
WIDE_TOKENS = np.array([2999, 4, 1500, 17, 2048, 1024, 0, 640, 2222, 333])


def test_on_a_wide_vocabulary_the_candidates_keep_the_distribution_without_drafts():
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.5)
    wide = np.full((3, WIDE_VOCAB), -30.0, dtype=np.float32)
    wide[:, WIDE_TOKENS] = ROW_LOGITS
    history = [int(WIDE_TOKENS[t]) for t in (1, 4, 6)]
    drafts = (int(WIDE_TOKENS[0]), int(WIDE_TOKENS[1]))
    rows = [SamplingRow(params, history, None)] * 3
    layout = Layout(rows)
    _, scaled = processed(layout, mx.array(wide), layout.initial_state(rows), candidates=True)
    assert isinstance(scaled, Candidates)  # the path under test is the candidates'
    seqs = [fake_sequence(params, history) for _ in range(DRAWS)]
    logits = mx.array(np.tile(wide[:3], (DRAWS, 1)))
    pending = verify(logits, seqs, [drafts] * DRAWS, key=mx.random.key(2027))
    mx.eval(pending.arrays())
    out = pending.read()
    first = np.bincount([tokens[0] for _, _, _, tokens in out], minlength=WIDE_VOCAB)
    assert_counts_follow(oracle_distribution(wide[0], params, history), first)
    second = np.bincount([tokens[1] for _, _, _, tokens in out if tokens[0] == drafts[0]],
                         minlength=WIDE_VOCAB)
    assert second.sum() > 500
    assert_counts_follow(oracle_distribution(wide[1], params, history + [drafts[0]]), second)
    # a draft among the far tokens (outside the nucleus, outside the candidates) never passes
    far = verify(logits[:2], seqs[:1], [(7,)], key=mx.random.key(5))
    mx.eval(far.arrays())
    assert far.read()[0][2] == 0


def test_greedy_rows_keep_the_drafts_that_equal_the_argmax_then_the_argmax():
    greedy = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    seqs = [fake_sequence(greedy, [7]), fake_sequence(greedy, [7]), fake_sequence(penalised, [0])]
    drafts = [(0, 1), (0, 4), (1, 1)]
    logits = mx.array(np.concatenate([ROW_LOGITS] * 3))
    pending = verify(logits, seqs, drafts)
    mx.eval(pending.arrays())
    out = [(m, tokens) for _, _, m, tokens in pending.read()]
    assert out[0] == (2, [0, 1, 4])  # both accepted, then row 2's argmax (the bonus)
    assert out[1] == (1, [0, 1])  # row 1's argmax is 1, not 4
    # penalised: token 0 (in the history) loses row 0 to token 1; row 1 then penalises
    # 1 as well (the accepted draft is in its window): 2.8/3 < 2.2 -> token 3
    assert out[2] == (1, [1, 3])


# ---- the engine -----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
CODE = "\n".join(f"def scale_{i}(values):\n    return [v * {i + 2} for v in values]"
                 for i in range(8))
EDIT = [{"role": "user", "content": "Repeat this code exactly, but rename scale_3 to "
                                    f"triple:\n\n{CODE}"}]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(kv_memory_mib=48, block_size=16, max_batch=8, prefill_chunk=256))
    eng.start()
    assert eng.wait_ready(600), eng.load_error
    yield eng
    eng.stop()


def counters(engine: Engine):
    wait_until(lambda: engine.snapshot() is not None)
    return engine.snapshot().counters


def idle_invariants(engine: Engine) -> None:
    runtime = engine.runtime
    wait_until(lambda: not runtime.scheduler.has_work)
    check_invariants(runtime.alloc, [])


@pytest.mark.model
def test_greedy_replies_with_drafts_equal_mlx_lm(engine):
    prompts = [chat_prompt(EDIT),
               chat_prompt([{"role": "user", "content": "Name three colours of the rainbow."}])]
    handles = [engine.submit(prompt_tokens=p, params=GREEDY, session_id=f"greedy-{i}")
               for i, p in enumerate(prompts)]
    got = [collect(h) for h in handles]
    for p, (tokens, finals) in zip(prompts, got):
        assert tokens[0] == greedy_reference(p, GREEDY.max_tokens)
        assert finals[0].usage.generated_tokens == len(tokens[0])
    c = counters(engine)
    assert c.accepted_draft_tokens > 10, "no draft was accepted: the test would be vacuous"
    idle_invariants(engine)


@pytest.mark.model
def test_max_tokens_and_a_stop_string_inside_accepted_drafts(engine):
    prompt = chat_prompt(EDIT)
    expected = greedy_reference(prompt, 30)
    tokens, finals = collect(engine.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=23),
        session_id="limit"))
    assert tokens[0] == expected[:23] and finals[0].finish_reason is FinishReason.LENGTH
    text = engine.decode(expected)
    stop = "scale_1"
    assert text.find(stop) > 0
    _, finals = collect(engine.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=30,
                                                    stop=(stop,)), session_id="stop"))
    assert finals[0].finish_reason is FinishReason.STOP
    assert finals[0].text == text[: text.find(stop)]
    idle_invariants(engine)


@pytest.mark.model
def test_greedy_samples_with_drafts_equal_mlx_lm(engine):
    prompt = chat_prompt(EDIT)
    tokens, _ = collect(engine.submit(
        prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=24, n=3),
        session_id="siblings"))
    expected = greedy_reference(prompt, 24)
    assert [tokens[i] for i in range(3)] == [expected] * 3
    idle_invariants(engine)


@pytest.mark.model
def test_a_regenerated_reply_drafts_from_the_one_it_replaces(engine):
    """Regenerate: the finished reply drafts the new one (greedy: the same tokens, so
    nearly every draft is kept), and the reply still equals mlx-lm's; an incognito
    request of the same prompt gets no draft from it."""
    prompt = chat_prompt([{"role": "user", "content": "Why do leaves change colour?"}])
    expected = greedy_reference(prompt, GREEDY.max_tokens)

    def accepted_in(session: str, incognito: bool = False) -> int:
        """Drafts accepted in one request (the engine's own tally, read while it idles:
        a snapshot's counters may be a step behind)."""
        idle_invariants(engine)
        before = engine.telemetry.accepted_draft_tokens
        tokens, _ = collect(engine.submit(prompt_tokens=prompt, params=GREEDY,
                                          session_id=session, incognito=incognito))
        assert tokens[0] == expected
        idle_invariants(engine)
        return engine.telemetry.accepted_draft_tokens - before

    first = accepted_in("leaves")
    private = accepted_in("leaves-incognito", incognito=True)
    again = accepted_in("leaves-again")
    # how many drafts a step verifies follows measured step times (under load fewer),
    # hence margins rather than the 33 of 39 an idle machine gives
    seen = f"accepted drafts: first {first}, incognito {private}, regenerated {again}"
    assert again >= first + 10, seen
    assert private <= first + 4, seen


def test_a_sibling_ahead_proposes_its_continuation():
    speculator = Speculator(max_draft=4)
    ahead = sibling(1, [40, 41, 42, 43, 44, 45])
    behind = sibling(2, [50, 40, 41])
    stranger = SimpleNamespace(**{**vars(sibling(3, [40, 41, 60, 61])),
                                  "tokens": [9, 9, 9, 40, 41, 60, 61]})
    assert speculator.propose(ahead) == []  # nothing after its suffix anywhere yet
    speculator.propose(stranger)  # another prompt: never a sibling
    # a new sequence's prior (one in three) against the unmeasured threshold (0.05): 2 drafts
    assert speculator.propose(behind) == [42, 43]
    speculator.forget(ahead)  # too short a reply to keep
    assert speculator.propose(behind) == []


PROMPT = [11, 12, 13]


def sibling(seq_id: int, reply: list[int], incognito: bool = False):
    """A decoding sequence of ``PROMPT`` as the speculator sees it."""
    request = SimpleNamespace(params=SamplingParams(temperature=0.7), beams=None,
                              incognito=incognito, request_id=f"r{seq_id}")
    return SimpleNamespace(seq_id=seq_id, request=request, tokens=PROMPT + reply,
                           num_prompt=len(PROMPT), matcher=None, finished=False,
                           num_generated=len(reply))


def test_an_earlier_reply_drafts_for_a_regenerated_one():
    """A finished reply stays a draft source for later requests with its prompt (the
    latest ``KEPT_REPLIES`` of the latest ``KEPT_PROMPTS`` prompts); an incognito reply is
    never kept, and an incognito sequence drafts from no other request's reply."""
    speculator = Speculator(max_draft=4)
    first = sibling(1, list(range(40, 52)))  # 12 tokens: kept
    speculator.forget(first)
    again = sibling(2, [40])
    assert speculator.propose(again) == [41, 42]  # 2 drafts at the prior, as above
    assert speculator.propose(sibling(3, [40], incognito=True)) == []
    secret = sibling(4, list(range(70, 82)), incognito=True)
    speculator.forget(secret)
    assert speculator.propose(sibling(5, [70])) == []
    for prompt in range(KEPT_PROMPTS):  # other prompts push the first one out
        other = sibling(10 + prompt, list(range(40, 52)))
        other.tokens = [prompt, 0, 0] + other.tokens[3:]
        speculator.forget(other)
    assert speculator.propose(sibling(6, [40])) == []


def test_an_overlapped_sequence_that_stopped_drafting_still_probes():
    """Overlapped (a GPU), the scheduler asks for a sequence's drafts only in a step that
    has its newest token on the host (engine/sched/draft_slots.py), which
    ``wants_host_step`` decides at the launch before. A sequence priced out of drafting
    must still get its probe after ``PROBE_EVERY`` tokens: on the H200 a regenerated greedy
    reply, whose earlier reply was all right, accepted no draft in 64 tokens because the
    probe's clock ticked only when the speculator was asked."""
    speculator = Speculator(max_draft=4, overlapped=True)
    for _ in range(4):  # plain steps of one row 10 ms, a step with one draft 16.7 ms
        speculator.cost.observe(0.010, decode_rows=1, draft_rows=0)
    speculator.cost.observe(0.0167, decode_rows=1, draft_rows=1)
    # the switch (6 ms) is more than a new sequence's expected kept tokens pay (one in
    # three, a third of a 10 ms step each): priced out
    assert speculator.cost.switch_s > 0.006
    reply = list(range(40, 90))
    speculator.forget(sibling(1, reply))  # the reply being regenerated, kept as drafts
    seq = sibling(2, reply[:1])
    on_host = True  # a new sequence's first step is read before the next one is planned
    drafted_at = []
    while seq.num_generated < len(reply) - 1:
        drafts = speculator.propose(seq) if on_host else []  # a token in flight: not asked
        if drafts:
            drafted_at.append(seq.num_generated)
            assert drafts == reply[seq.num_generated:seq.num_generated + len(drafts)]
        on_host = speculator.wants_host_step([seq])  # at this step's launch
        seq.tokens.append(reply[seq.num_generated])  # its token, read
        seq.num_generated += 1
    assert drafted_at and drafted_at[0] <= PROBE_EVERY + 1, drafted_at


def overlapped_run(speculator: Speculator, seq, reply: list[int]) -> tuple[list[int], list[int]]:
    """Decode ``reply`` as an overlapped engine calls the speculator: asked for drafts only
    in a step whose newest token is on the host, which ``wants_host_step`` decided at the
    launch before. Returns where it drafted and which steps gave up the overlap."""
    on_host = True  # a new sequence's first step is read before the next one is planned
    drafted_at, synchronous = [], []
    while seq.num_generated < len(reply):
        drafts = speculator.propose(seq) if on_host else []
        if drafts:
            drafted_at.append(seq.num_generated)
        on_host = speculator.wants_host_step([seq])
        if on_host:
            synchronous.append(seq.num_generated)
        seq.tokens.append(reply[seq.num_generated])
        seq.num_generated += 1
    return drafted_at, synchronous


@pytest.mark.parametrize("priced", ["out", "in"])
def test_a_chat_that_never_repeats_keeps_the_overlap(priced):
    """A step that asks for a token on the host gives up the overlap for the whole batch.
    A sequence whose lookups find nothing must not ask every step: after ``e9f4f55`` a
    sequence priced out of drafting asked every step once its probe was due, as long as its
    text did not repeat (here 185 of 200 steps), and a sequence priced in asked every step
    from the start (199 of 200). With the back-off it asks about once per ``PROBE_EVERY``
    tokens; when its text turns repetitive it drafts again within ``PROBE_EVERY`` tokens."""
    speculator = Speculator(max_draft=4, overlapped=True)
    for _ in range(4):
        speculator.cost.observe(0.010, decode_rows=1, draft_rows=0)
    speculator.cost.observe(0.0167 if priced == "out" else 0.0101, decode_rows=1,
                            draft_rows=1)
    fresh = list(range(5000, 5200))  # no token of it occurs twice, nor in the prompt
    seq = sibling(3, fresh[:1])
    speculator._state(seq)
    # priced in: its expected kept tokens pay the switch (measured at nothing), so it asks
    assert speculator.wants_host_step([seq]) == (priced == "in")
    drafted_at, synchronous = overlapped_run(speculator, seq, fresh)
    assert not drafted_at
    assert len(synchronous) <= len(fresh) // PROBE_EVERY + 6, synchronous
    # the text repeats from here on: its own earlier tokens are drafts again
    repeated = fresh + fresh[:120]
    drafted_at, _ = overlapped_run(speculator, seq, repeated)
    assert drafted_at and drafted_at[0] <= len(fresh) + PROBE_EVERY + 1, drafted_at


def test_a_priced_out_regenerate_copies_its_earlier_reply_in_long_probes():
    """The H100's GPU check: a regenerated greedy reply, whose earlier reply is the reply,
    kept 2 and 7 drafts of 64 at abcf6ec, and 18 (kernel path) at 897bb70. Overlapped, a step
    that drafts waits for its host token (here 1.5 ms of lost overlap beside 1 ms steps, a
    tiny model's launch-bound steps), and a probe of one draft carried that whole cost as one
    row's price: drafting stayed priced out, and one-draft probes every ``PROBE_EVERY``
    tokens taught the acceptance too slowly. Now a probe whose lookup matched a whole
    ``MAX_NGRAM`` suffix verifies the continuation it found, and a step that kept several
    drafts, all of them, is followed by another probe at once: the copy runs in steps of
    ``MAX_DRAFT`` + 1 tokens (abcf6ec's rule: 3 accepted here; 897bb70's: 24). Pure
    bookkeeping on the overlapped calling pattern."""
    plain_s, lost_overlap_s, row_s = 0.0010, 0.0015, 0.00005
    speculator = Speculator(overlapped=True)
    for _ in range(StepCost.WINDOW):  # an engine that ran before: plain steps, 1-draft probes
        speculator.cost.observe(plain_s, decode_rows=1, draft_rows=0)
        speculator.cost.observe(plain_s + lost_overlap_s + row_s, decode_rows=1, draft_rows=1)
    # the switch costs more than a whole step: a new sequence's expected kept tokens (under
    # one) cannot pay it
    assert speculator.cost.switch_s > plain_s
    reply = list(range(100, 180))
    speculator.forget(sibling(1, reply))  # the reply being regenerated, kept as drafts
    seq = sibling(2, reply[:1])
    on_host, accepted = True, 0
    while seq.num_generated < 64:
        drafts = speculator.propose(seq) if on_host else []
        assert drafts == reply[seq.num_generated:seq.num_generated + len(drafts)]
        if drafts:
            speculator.record(seq, len(drafts), len(drafts))  # greedy: the same reply
        speculator.observe_step(plain_s + (lost_overlap_s if on_host else 0.0)
                                + row_s * len(drafts), 1, len(drafts), 0)
        kept = reply[seq.num_generated:seq.num_generated + 1 + len(drafts)]
        seq.tokens += kept
        seq.num_generated += len(kept)
        accepted += len(drafts)
        on_host = speculator.wants_host_step([seq])
    assert accepted >= 2 * 64 // 3, accepted  # the GPU check's bar is a third


def test_a_regenerated_reply_drafts_its_earlier_reply_at_the_same_position():
    """A reply that repeats itself (a small model's greedy loops: on the CPU's GPU check a
    regenerated greedy reply kept 16-23 drafts of 64 in some runs) has n-grams whose latest
    occurrence continues differently from the one at the regenerated reply's position; the
    aligned continuation comes first, the n-gram index after."""
    loop = [7, 8, 9, 10]
    reply = [50, 51] + loop + [60, 61, 62] + loop + [70, 71, 72, 73]
    speculator = Speculator()
    speculator.forget(sibling(1, reply))
    seq = sibling(2, reply[:6])  # its newest tokens are the loop's first occurrence
    assert speculator.propose(seq)[:2] == [60, 61]  # not [70, 71]
    live = sibling(3, reply[:12])  # a sibling still decoding, ahead
    behind = sibling(4, reply[:6])
    speculator._state(live)
    assert speculator.propose(behind)[:2] == [60, 61]
    speculator = Speculator()
    speculator.forget(sibling(1, reply))
    shifted = sibling(5, [50] + loop)  # the loop a token earlier: the n-gram's latest
    assert speculator.propose(shifted)[:2] == [70, 71]


def test_a_probe_that_keeps_a_single_draft_waits_for_the_next_one():
    """Only a step that kept several drafts, all of them, probes again at once: a probe of
    one kept draft (an ordinary chat's chance match) waits ``PROBE_EVERY`` tokens, so chance
    matches do not make a priced-out row give up the overlap step after step."""
    speculator = Speculator()
    seq = sibling(4, list(range(300, 340)))
    state = speculator._state(seq)
    speculator.record(seq, drafted=1, accepted=1)
    assert not state.probe_due(state.last_try + 1)
    speculator.record(seq, drafted=3, accepted=3)
    assert state.probe_due(state.last_try + 1)
    speculator.record(seq, drafted=3, accepted=2)
    assert not state.probe_due(state.last_try + 1)


def chat(seq_id: int, prompt: list[int], reply: list[int]):
    """A decoding sequence of its own ``prompt`` (no sibling of the others)."""
    seq = sibling(seq_id, reply)
    seq.tokens, seq.num_prompt = prompt + reply, len(prompt)
    return seq


def overlapped_batch(speculator: Speculator, seqs, texts, steps: int, plain_s: float,
                     switch_s: float, greedy: bool) -> tuple[int, int]:
    """``seqs`` decode ``texts`` (each its reply to come) for ``steps`` steps as an
    overlapped engine drives the speculator: drafts asked only in a step whose tokens are on
    the host, which ``wants_host_step`` decided at the launch before; each step timed as
    ``plain_s``, plus ``switch_s`` when it drafted (the lost overlap). ``greedy``: a draft
    is kept while it equals the text (a greedy reply); else every draft is rejected (a
    sampled reply's chance matches). Returns (steps that gave the overlap up, drafts kept)."""
    on_host, synchronous, kept = True, 0, 0
    for _ in range(steps):
        drafted = 0
        for seq, text in zip(seqs, texts):
            drafts = speculator.propose(seq) if on_host else []
            at = seq.num_generated
            accepted = 0
            if greedy:
                while accepted < len(drafts) and drafts[accepted] == text[at + accepted]:
                    accepted += 1
            if drafts:
                speculator.record(seq, len(drafts), accepted)
            new = text[at:at + 1 + accepted]
            seq.tokens += new
            seq.num_generated += len(new)
            kept += accepted
            drafted += len(drafts)
        speculator.observe_step(plain_s + (switch_s if drafted else 0.0), len(seqs), drafted, 0)
        on_host = speculator.wants_host_step(seqs)
        synchronous += on_host
    return synchronous, kept


def test_overlapped_sampled_chats_give_the_overlap_up_once_a_beat():
    """On the H100, drafting forced on made 8 sampled chats 0.77x and one 0.92x
    (bench/results/speculative_gpu.md): their text offers chance matches (a 1-token n-gram
    nearly always occurs earlier), each row probed on its own clock, and the lost overlap
    was priced per draft row, split among a step's drafts. Overlapped, the batch now gives
    its overlap up for probes on a shared beat only, and for drafting only when the
    expected kept tokens pay for the switch: 8 chats whose drafts are all rejected run at
    most one synchronous step a beat."""
    rng = np.random.default_rng(5)
    texts = [list(rng.integers(1000, 1040, 400)) for _ in range(8)]  # chance matches
    seqs = [chat(10 + i, [900 + i, 901 + i], t[:1]) for i, t in enumerate(texts)]
    speculator = Speculator(overlapped=True)
    steps = 320
    synchronous, _ = overlapped_batch(speculator, seqs, texts, steps, plain_s=0.005,
                                      switch_s=0.002, greedy=False)
    # (the per-row rule before, any row asking for its token on the host, gave it up in
    # more than twice as many steps of this same run)
    assert synchronous <= steps // PROBE_EVERY + 4, synchronous


def test_an_overlapped_copy_among_sampled_chats_still_drafts():
    """The switch priced per step must not price out what pays: a greedy regenerate whose
    earlier reply is the reply, decoding beside three sampled chats, keeps most of its
    tokens as drafts (the GPU check's bar is a third of 64)."""
    rng = np.random.default_rng(6)
    reply = list(range(2000, 2100))
    speculator = Speculator(overlapped=True)
    speculator.forget(sibling(1, reply))  # the reply being regenerated, kept as drafts
    others = [list(rng.integers(1000, 1040, 200)) for _ in range(3)]
    seqs = [sibling(2, reply[:1])] + [chat(20 + i, [950 + i], t[:1]) for i, t in enumerate(others)]
    texts = [reply] + others
    _, kept = overlapped_batch(speculator, seqs[:1] + seqs[1:], texts, 40, plain_s=0.005,
                               switch_s=0.002, greedy=True)
    copied = seqs[0].num_generated - 1
    assert copied >= 64 and kept >= 2 * 64 // 3, (copied, kept)


@pytest.mark.model
def test_cancel_mid_draft_and_sampled_drafts_leave_no_block_behind(engine):
    prompt = chat_prompt(EDIT)
    # greedy: a sampled reply may end at once ("```" then EOS, 1 run in 3), before the cancel
    handle = engine.submit(prompt_tokens=prompt, params=SamplingParams(
        temperature=0.0, max_tokens=200), session_id="cancel")
    events = iter(handle)
    next(events)  # some tokens are out: it is drafting
    handle.cancel()
    finals = [e for e in events if isinstance(e, FinalEvent)]
    assert finals and finals[-1].finish_reason is FinishReason.CANCELLED
    sampled = SamplingParams(temperature=0.5, top_p=0.95, repetition_penalty=1.1,
                             max_tokens=24)
    tokens, finals = collect(engine.submit(prompt_tokens=prompt, params=sampled,
                                           session_id="sampled"))
    assert len(tokens[0]) == finals[0].usage.generated_tokens <= 24
    idle_invariants(engine)


@pytest.mark.model
def test_an_8_bit_pool_rolls_drafts_back_too():
    eng = Engine(EngineConfig(kv_memory_mib=16, block_size=16, max_batch=2,
                              kv_precision="int8"))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        prompt = chat_prompt(EDIT)
        with_drafts, _ = collect(eng.submit(prompt_tokens=prompt, params=GREEDY,
                                            session_id="int8"))
        assert counters(eng).accepted_draft_tokens > 10
        idle_invariants(eng)
        eng.runtime.stepper.speculator.enabled = False  # idle: the engine thread waits
        without, _ = collect(eng.submit(prompt_tokens=prompt, params=GREEDY,
                                        session_id="int8-plain"))
        assert with_drafts[0] == without[0]
        idle_invariants(eng)
    finally:
        eng.stop()


def test_a_step_slowed_by_the_machine_is_not_read_as_the_price_of_drafts():
    """Plain steps of 3 rows take 70 ms and each draft row 4 ms more (a CPU profile of the
    default model), so a draft must add 4 * 3 / 70 = 0.17 tokens to pay. A few steps slowed
    by another process (1 s) must not move that much: with running means they priced
    drafting out for good (a threshold above 1) on a busy machine."""
    rng = np.random.default_rng(0)
    cost = StepCost()
    for i in range(40):
        spike = 1.0 if i % 13 == 5 else 0.0
        jitter = float(rng.normal(0, 0.002))
        if i % 2:
            cost.observe(0.070 + 4 * 0.004 + jitter + spike, decode_rows=3, draft_rows=4)
        else:
            cost.observe(0.070 + jitter + spike, decode_rows=3, draft_rows=0)
    assert cost.threshold() == pytest.approx(4 * 3 / 70, rel=0.25)


@pytest.mark.model
def test_drafts_verified_as_decode_rows_give_mlx_lm_greedy_replies(monkeypatch):
    """Where the decode attention is a kernel, a verifying work is laid out as decode rows
    (engine/runner/step_batch.py). Forced here onto the CPU's reference decode path, which
    takes any rows: the replies must still be mlx-lm's, through rollbacks and siblings."""
    from engine.runner import step_batch
    from engine.runner.model_adapter import PagedModel

    monkeypatch.setattr(PagedModel, "decode_kernel", property(lambda self: True))
    verified_as_decodes = []
    real_build = step_batch.build_step_batch

    def build(works, bucketed=None, drafts_as_decodes=False, row_fit=None):
        batch = real_build(works, bucketed, drafts_as_decodes, row_fit)
        if drafts_as_decodes and any(w.drafts for w in works):
            verified_as_decodes.append(len(batch.prefills))
        return batch

    import engine.runner.step as step_module
    monkeypatch.setattr(step_module, "build_step_batch", build)
    eng = Engine(EngineConfig(kv_memory_mib=48, block_size=16, max_batch=8, prefill_chunk=256,
                              speculative=True))
    eng.start()
    try:
        assert eng.wait_ready(600), eng.load_error
        prompt = chat_prompt(EDIT)
        tokens, _ = collect(eng.submit(
            prompt_tokens=prompt, params=SamplingParams(temperature=0.0, max_tokens=40, n=2),
            session_id="as-decodes"))
        expected = greedy_reference(prompt, 40)
        assert [tokens[0], tokens[1]] == [expected, expected]
        assert counters(eng).accepted_draft_tokens > 10
        assert verified_as_decodes and not any(verified_as_decodes), (
            "no verifying step went through the decode rows: the test exercises nothing")
        idle_invariants(eng)
    finally:
        eng.stop()
