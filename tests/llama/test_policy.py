"""Restore planning (``shmkv.llama.policy``) against a fake arena view: no llama.cpp, no supervisor.

The fake view holds records (token id lists) indexed as the supervisor's store
indexes them: every full chunk prefix of a record points at one of the records
that own it (the longest of those ending within the next chunk, else the
shortest). Hypothesis draws records that share prefixes with a prompt, and each
test states one property of the plan in its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmkv.core.arena import Hit, Slot, common_prefix
from shmkv.core.errors import ArenaCorruptError
from shmkv.core.keys import chain_digests
from shmkv.llama.policy import (
    EVERYONE,
    SWA_MAX_PROBES,
    SWA_MIN_GAIN,
    WHOLE,
    Exact,
    Local,
    Lookup,
    Plain,
    Plan,
    Rules,
    SlidingWindow,
    Trust,
    context_allows_cut,
    coverage,
    strategy,
    window_allows_cut,
)

ROOT = bytes(range(16))
CHUNK = 4
N_SWA = 8
ALIGN = 8

#: pure functions on small inputs: many examples, no deadline (a loaded machine is slow)
CHECK = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------- fake view
@dataclass(frozen=True)
class Rec:
    n_tokens: int
    tokens: np.ndarray
    publisher: int = 0


class FakeArena:
    """Records and the index over their chunk prefixes, as a worker's view sees them."""

    def __init__(self, records: Sequence[Sequence[int]], corrupt: Sequence[int] = ()) -> None:
        self.recs: dict[tuple[int, int], Rec] = {}
        self.corrupt: set[tuple[int, int]] = set()
        owners: dict[bytes, dict[int, int]] = {}  # digest -> {gen: n_tokens}
        seen: set[tuple[int, ...]] = set()
        for i, toks in enumerate(records):
            if tuple(toks) in seen or len(toks) < CHUNK:  # (the store keeps one of each)
                continue
            seen.add(tuple(toks))
            gen = i + 1
            key = (gen * 4096, gen)
            self.recs[key] = Rec(len(toks), np.asarray(toks, dtype=np.int32))
            if i in corrupt:
                self.corrupt.add(key)
            for d in chain_digests(ROOT, toks, CHUNK):
                owners.setdefault(d, {})[gen] = len(toks)
        self.owners_of = owners
        self.index: dict[bytes, Slot] = {}
        for d, own in owners.items():
            nch = next(
                k
                for (off, g), r in self.recs.items()
                if g in own
                for k, dd in enumerate(chain_digests(ROOT, r.tokens, CHUNK), 1)
                if dd == d
            )
            limit = (nch + 1) * CHUNK
            ending = [g for g, n in own.items() if n < limit]
            gen = (
                max(ending, key=lambda g: (own[g], -g))
                if ending
                else min(own, key=lambda g: (own[g], g))
            )
            self.index[d] = Slot(d, gen * 4096, gen, nch)
        self.owner_calls = 0

    # the ArenaReader protocol
    def probe(self, digest: bytes) -> Slot | None:
        return self.index.get(digest)

    def find_longest(self, digests: Sequence[bytes]) -> tuple[int, Slot] | None:
        best = None
        for k, d in enumerate(digests, 1):
            if d in self.index:
                best = (k, self.index[d])
        return best

    def read_record(self, offset: int, gen: int) -> Rec:
        if (offset, gen) not in self.recs or (offset, gen) in self.corrupt:
            raise ArenaCorruptError(f"no record at {offset}")
        return self.recs[(offset, gen)]

    def tokens(self, rec: Rec) -> np.ndarray:
        return rec.tokens

    def peek(self, offset: int, gen: int) -> tuple[Rec, np.ndarray]:
        rec = self.read_record(offset, gen)
        return rec, rec.tokens

    # the supervisor's owners op
    def owners(self, digest: bytes, prompt: np.ndarray) -> list[tuple[int, int, int, int]]:
        self.owner_calls += 1
        out = []
        for gen in self.owners_of.get(digest, {}):
            rec = self.recs[(gen * 4096, gen)]
            c = common_prefix(rec.tokens, prompt)
            out.append((gen * 4096, gen, rec.n_tokens, min(c, rec.n_tokens, len(prompt))))
        return out

    # helpers for the properties
    def record(self, hit: Hit) -> Rec:
        return self.recs[(hit.slot.rec_offset, hit.slot.rec_gen)]

    def sharing(self, prompt: np.ndarray, chunks: int) -> list[Rec]:
        """Records that share at least ``chunks`` full chunks with ``prompt``."""
        return [r for r in self.recs.values() if common_prefix(r.tokens, prompt) >= chunks * CHUNK]


# ----------------------------------------------------------------------- strategies
TOKEN = st.integers(0, 3)


@st.composite
def scenes(draw: st.DrawFn, max_local: int | None = 0) -> tuple[FakeArena, np.ndarray, int]:
    """An arena of records that branch off one trunk, a prompt that does too, and how many
    of the prompt's tokens the context already holds."""
    trunk = draw(st.lists(TOKEN, min_size=CHUNK * 2, max_size=80))
    records = []
    for _ in range(draw(st.integers(0, 7))):
        cut = draw(st.integers(0, len(trunk)))
        records.append(trunk[:cut] + draw(st.lists(TOKEN, max_size=24)))
    cut = draw(st.integers(CHUNK, len(trunk)))
    prompt = np.asarray(trunk[:cut] + draw(st.lists(TOKEN, max_size=24)), dtype=np.int32)
    corrupt = draw(st.sets(st.integers(0, 7), max_size=1)) if draw(st.booleans()) else set()
    local = 0 if max_local == 0 else draw(st.integers(0, len(prompt)))
    return FakeArena(records, sorted(corrupt)), prompt, local


def plan_for(
    strat: object, arena: FakeArena, prompt: np.ndarray, local: int, trust: Trust = EVERYONE
) -> Plan:
    digests = chain_digests(ROOT, prompt, CHUNK)
    found = arena.find_longest(digests)
    hit = None if found is None else Hit(found[0], found[1])

    def owners(digest: bytes, prompt: np.ndarray) -> list[tuple[int, int, int, int]]:
        rows = arena.owners(digest, prompt)  # (the supervisor keeps trusted publishers' only)
        return [r for r in rows if trust.allows(arena.recs[(r[0], r[1])].publisher)]

    return strat.plan(Lookup(arena, prompt, CHUNK, digests, hit, local, owners, trust))


def longest(arena: FakeArena, prompt: np.ndarray) -> int:
    found = arena.find_longest(chain_digests(ROOT, prompt, CHUNK))
    return 0 if found is None else found[0]


def restored(arena: FakeArena, plan: Plan, prompt: np.ndarray) -> int:
    """What the apply step would keep of the planned record."""
    assert plan.hit is not None
    return min(common_prefix(arena.record(plan.hit).tokens, prompt), plan.keep)


PLAIN = Plain(Rules())
WINDOW = SlidingWindow(Rules(n_swa=N_SWA, min_tokens=CHUNK, checkpoint_tail=6))
EXACT = Exact(Rules(exact=True, align=ALIGN, min_tokens=CHUNK))
EXACT_WINDOW = Exact(Rules(exact=True, align=ALIGN, n_swa=N_SWA, min_tokens=CHUNK))


# ----------------------------------------------------------------------- any strategy
def test_strategy_is_chosen_by_exact_mode_then_window() -> None:
    assert type(strategy(Rules())) is Plain
    assert type(strategy(Rules(n_swa=4))) is SlidingWindow
    assert type(strategy(Rules(exact=True, n_swa=4))) is Exact


@pytest.mark.parametrize("n_swa", [0, 4, WHOLE], ids=["plain", "window", "recurrent"])
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_only_a_strategy_that_cuts_any_state_back_fetches_records_it_would_cut(
    n_swa: int, exact: bool
) -> None:
    """The remote tier fetches records that go on past the prompt only for a worker that
    can cut a state back anywhere: the same rule as a restore's."""
    strat = strategy(Rules(n_swa=n_swa, exact=exact, align=ALIGN))
    assert strat.cuts_back == window_allows_cut(n_swa, 100_000, 1_000)


@pytest.mark.parametrize(
    "strat", [PLAIN, WINDOW, EXACT, EXACT_WINDOW], ids=["plain", "window", "exact", "exact-window"]
)
@CHECK
@given(scene=scenes(max_local=None))
def test_a_leased_record_shares_its_key_chunks_with_the_prompt_and_beats_the_context(
    strat, scene
) -> None:
    arena, prompt, local = scene
    plan = plan_for(strat, arena, prompt, local)
    if plan.hit is None or (plan.hit.slot.rec_offset, plan.hit.slot.rec_gen) in arena.corrupt:
        return
    rec = arena.record(plan.hit)
    assert common_prefix(rec.tokens, prompt) >= plan.hit.chunks * CHUNK
    assert common_prefix(rec.tokens, prompt) > local


@pytest.mark.parametrize("strat", [PLAIN, WINDOW, EXACT], ids=["plain", "window", "exact"])
@CHECK
@given(scene=scenes(max_local=None))
def test_a_miss_means_no_lease_and_less_than_a_chunk_in_the_context(strat, scene) -> None:
    arena, prompt, local = scene
    plan = plan_for(strat, arena, prompt, local)
    if plan.miss:
        assert plan.hit is None and local < CHUNK
    if longest(arena, prompt) == 0 and local < CHUNK:
        assert plan.miss


# ----------------------------------------------------------------------- trust
MINE = Trust(frozenset({0}))


@pytest.mark.parametrize(
    "strat", [PLAIN, WINDOW, EXACT, EXACT_WINDOW], ids=["plain", "window", "exact", "exact-window"]
)
@CHECK
@given(scene=scenes(max_local=None), data=st.data())
def test_a_plan_never_leases_a_record_of_an_untrusted_publisher(strat, scene, data) -> None:
    arena, prompt, local = scene
    keys = sorted(arena.recs)
    others = data.draw(st.sets(st.sampled_from(keys))) if keys else set()
    for key in others:
        arena.recs[key] = replace(arena.recs[key], publisher=1)
    plan = plan_for(strat, arena, prompt, local, MINE)
    if plan.hit is not None:
        key = (plan.hit.slot.rec_offset, plan.hit.slot.rec_gen)
        assert key in arena.corrupt or arena.recs[key].publisher == 0
    if not others:  # (one publisher, as without --group: trust changes nothing)
        assert plan == plan_for(strat, arena, prompt, local)


@CHECK
@given(scene=scenes(), data=st.data())
def test_plain_restores_a_trusted_record_beside_an_untrusted_one_the_index_points_at(
    scene, data
) -> None:
    arena, prompt, _ = scene
    k = longest(arena, prompt)
    if not k:
        return
    digest = chain_digests(ROOT, prompt, CHUNK)[k - 1]
    slot = arena.index[digest]
    top = (slot.rec_offset, slot.rec_gen)
    beside = [g for g in arena.owners_of[digest] if (g * 4096, g) != top]
    if not beside or top in arena.corrupt:
        return
    arena.recs[top] = replace(arena.recs[top], publisher=1)
    plan = plan_for(PLAIN, arena, prompt, 0, MINE)
    assert plan.hit is not None and plan.hit.chunks == k and plan.untrusted == 1
    assert (plan.hit.slot.rec_offset, plan.hit.slot.rec_gen) != top


# ----------------------------------------------------------------------- plain
@CHECK
@given(scene=scenes())
def test_plain_leases_the_longest_cached_chunk_prefix_and_never_asks_owners(scene) -> None:
    arena, prompt, _ = scene
    plan = plan_for(PLAIN, arena, prompt, 0)
    best = max((common_prefix(r.tokens, prompt) // CHUNK for r in arena.recs.values()), default=0)
    assert (plan.hit.chunks if plan.hit else 0) == best
    assert plan.keep == (len(prompt) if plan.hit else 0) or plan.hit is None
    assert arena.owner_calls == 0 and plan.checkpoint == 0 and not plan.window_unusable


@CHECK
@given(scene=scenes(max_local=None))
def test_plain_skips_the_lease_only_when_the_context_holds_about_as_much(scene) -> None:
    """No lease when the cached prefix ends within a chunk of what the context holds, or
    its record (looked at without a lease) gives no more; a record that does not parse
    is leased, so the lease path can count it."""
    arena, prompt, local = scene
    plan = plan_for(PLAIN, arena, prompt, local)
    k = longest(arena, prompt)
    if k and plan.hit is None and k * CHUNK + CHUNK > local:
        slot = arena.index[chain_digests(ROOT, prompt, CHUNK)[k - 1]]
        rec = arena.recs[(slot.rec_offset, slot.rec_gen)]
        assert (slot.rec_offset, slot.rec_gen) not in arena.corrupt
        assert common_prefix(rec.tokens, prompt) <= local


@CHECK
@given(scene=scenes())
def test_a_record_that_does_not_parse_is_still_leased_so_the_lease_path_counts_it(scene):
    arena, prompt, _ = scene
    k = longest(arena, prompt)
    if not k:
        return
    slot = arena.index[chain_digests(ROOT, prompt, CHUNK)[k - 1]]
    if (slot.rec_offset, slot.rec_gen) not in arena.corrupt:
        return
    for strat in (PLAIN, WINDOW):
        assert plan_for(strat, arena, prompt, 0).hit == Hit(k, slot)


# ----------------------------------------------------------------------- sliding window
@CHECK
@given(n_swa=st.integers(1, 16), n_state=st.integers(0, 64), keep=st.integers(0, 64))
def test_window_cut_is_allowed_only_if_the_state_holds_every_position_the_cut_needs(
    n_swa, n_state, keep
) -> None:
    """A state of n tokens keeps positions n - n_swa .. n - 1; evaluating after `keep`
    needs keep - n_swa + 1 .. keep - 1. A state is always usable whole."""
    held = set(range(max(0, n_state - n_swa), n_state))
    needed = set(range(max(0, keep - n_swa + 1), min(keep, n_state)))
    if window_allows_cut(n_swa, n_state, keep):
        assert keep >= n_state or needed <= held
    assert window_allows_cut(n_swa, n_state, n_state)
    assert window_allows_cut(0, n_state, keep)  # no window: any cut


@CHECK
@given(scene=scenes())
def test_window_plan_never_cuts_a_state_back_past_its_window(scene) -> None:
    arena, prompt, _ = scene
    plan = plan_for(WINDOW, arena, prompt, 0)
    if plan.hit is None or (plan.hit.slot.rec_offset, plan.hit.slot.rec_gen) in arena.corrupt:
        return
    rec = arena.record(plan.hit)
    keep = restored(arena, plan, prompt)
    assert window_allows_cut(N_SWA, rec.n_tokens, min(keep, len(prompt) - 1))


@CHECK
@given(scene=scenes())
def test_window_plan_restores_the_best_whole_state_under_the_longest_prefix(scene) -> None:
    """Among the records that share the longest cached chunk prefix, the plan restores as
    much as the best one that can be cut (or taken whole) for this prompt."""
    arena, prompt, _ = scene
    k = longest(arena, prompt)
    if not k or arena.corrupt:
        return
    n = len(prompt)
    fitting = [
        common_prefix(r.tokens, prompt)
        for r in arena.sharing(prompt, k)
        if window_allows_cut(N_SWA, r.n_tokens, min(common_prefix(r.tokens, prompt), n - 1))
    ]
    plan = plan_for(WINDOW, arena, prompt, 0)
    if fitting:
        assert plan.hit is not None and plan.hit.chunks == k and not plan.window_unusable
        assert restored(arena, plan, prompt) >= min(max(fitting), n - 1)
    else:
        assert plan.window_unusable


@CHECK
@given(scene=scenes())
def test_window_plan_asks_owners_once_at_most_and_not_when_the_indexed_state_fits(scene):
    arena, prompt, _ = scene
    plan_for(WINDOW, arena, prompt, 0)
    k = longest(arena, prompt)
    assert arena.owner_calls <= 1
    if k:
        slot = arena.index[chain_digests(ROOT, prompt, CHUNK)[k - 1]]
        rec = arena.recs[(slot.rec_offset, slot.rec_gen)]
        c = common_prefix(rec.tokens, prompt)
        if c >= len(prompt) - 1 and window_allows_cut(N_SWA, rec.n_tokens, len(prompt) - 1):
            assert arena.owner_calls == 0


@CHECK
@given(scene=scenes())
def test_window_plan_falls_back_to_the_longest_shorter_prefix_whose_state_fits(scene):
    """When no state under the longest prefix fits, the plan takes the longest shorter
    chunk prefix whose indexed state fits the prompt whole; none, if none does."""
    arena, prompt, _ = scene
    k = longest(arena, prompt)
    plan = plan_for(WINDOW, arena, prompt, 0)
    if not k or not plan.window_unusable or arena.corrupt:
        return
    digests = chain_digests(ROOT, prompt, CHUNK)
    n = len(prompt)

    def fits(j: int) -> bool:
        slot = arena.index.get(digests[j - 1])
        if slot is None:
            return False
        rec = arena.recs[(slot.rec_offset, slot.rec_gen)]
        return window_allows_cut(N_SWA, rec.n_tokens, min(common_prefix(rec.tokens, prompt), n - 1))

    shorter = [j for j in range(k - 1, max(0, k - 1 - SWA_MAX_PROBES), -1) if fits(j)]
    if plan.hit is None:
        assert not shorter
    else:
        assert plan.hit.chunks < k and fits(plan.hit.chunks)
        assert plan.hit.chunks == shorter[0]


@CHECK
@given(scene=scenes(max_local=None))
def test_window_checkpoint_is_where_the_prompt_leaves_a_cached_state(scene) -> None:
    arena, prompt, local = scene
    plan = plan_for(WINDOW, arena, prompt, local)
    if not plan.checkpoint:
        return
    n = len(prompt)
    have = max(local, plan.known or 0)
    assert have + SWA_MIN_GAIN <= plan.checkpoint < n - 1 and plan.checkpoint >= CHUNK
    assert any(common_prefix(r.tokens, prompt) == plan.checkpoint for r in arena.recs.values())


@CHECK
@given(
    system=st.lists(TOKEN, min_size=SWA_MIN_GAIN, max_size=60),
    cached=st.lists(TOKEN, min_size=N_SWA + 2, max_size=20),
    asked=st.lists(TOKEN, min_size=2, max_size=20),
)
def test_window_prompt_sharing_only_a_system_prompt_checkpoints_where_they_part(
    system, cached, asked
) -> None:
    """A cached prompt (system + question) cannot be cut back to the system prompt: the
    next prompt with another question restores nothing and publishes that state."""
    if asked[0] == cached[0]:
        asked = [(asked[0] + 1) % 4, *asked[1:]]
    arena = FakeArena([system + cached])
    prompt = np.asarray(system + asked, dtype=np.int32)
    plan = plan_for(WINDOW, arena, prompt, 0)
    assert plan.hit is None and plan.window_unusable
    assert plan.checkpoint == len(system)


@CHECK
@given(n=st.integers(1, 80), common=st.integers(0, 80), pos_min=st.integers(-1, 80))
def test_window_context_keeps_its_own_tokens_only_if_it_still_holds_their_window(
    n, common, pos_min
) -> None:
    common = min(common, n)
    keep, cut = WINDOW.keep_local(Local(common, pos_min), n)
    if keep:
        assert keep == common and not cut
        assert context_allows_cut(N_SWA, pos_min, min(keep, n - 1))
    elif common:
        assert cut and not context_allows_cut(N_SWA, pos_min, min(common, n - 1))


@CHECK
@given(n=st.integers(1, 120), reused=st.integers(0, 120), divergence=st.integers(0, 120))
def test_window_prefill_checkpoint_is_the_divergence_else_a_tail_the_prompt_cannot_cut(
    n, reused, divergence
) -> None:
    reused, divergence = min(reused, n), min(divergence, n)
    points = WINDOW.checkpoints(n, reused, divergence, CHUNK).points
    assert len(points) <= 1 and all(reused < p < n - 1 for p in points)
    if points and not divergence:
        at = points[0]
        assert at == n - 6 and at >= reused + SWA_MIN_GAIN and at >= CHUNK
        assert not window_allows_cut(N_SWA, n, at)
    if divergence and reused < divergence < n - 1:
        assert points == [divergence]


# ----------------------------------------------------------------------- exact
@pytest.mark.parametrize("strat", [EXACT, EXACT_WINDOW], ids=["exact", "exact-window"])
@CHECK
@given(scene=scenes(max_local=None))
def test_exact_plan_restores_only_at_batch_boundaries_of_matching_states(strat, scene):
    arena, prompt, local = scene
    plan = plan_for(strat, arena, prompt, local)
    if plan.hit is None or (plan.hit.slot.rec_offset, plan.hit.slot.rec_gen) in arena.corrupt:
        return
    rec = arena.record(plan.hit)
    assert plan.keep % ALIGN == 0 and local < plan.keep <= len(prompt) - 1
    assert plan.hit.chunks * CHUNK == plan.keep
    assert common_prefix(rec.tokens, prompt) >= plan.keep
    assert window_allows_cut(strat.n_swa, rec.n_tokens, plan.keep)


@pytest.mark.parametrize("strat", [EXACT, EXACT_WINDOW], ids=["exact", "exact-window"])
@CHECK
@given(scene=scenes(max_local=None))
def test_exact_plan_takes_the_longest_boundary_an_indexed_state_gives(strat, scene):
    arena, prompt, local = scene
    if arena.corrupt:
        return
    k = longest(arena, prompt)
    digests = chain_digests(ROOT, prompt, CHUNK)
    usable = []
    for p in range(ALIGN, min(k * CHUNK, len(prompt) - 1) + 1, ALIGN):
        slot = arena.index.get(digests[p // CHUNK - 1])
        if p > local and slot is not None:
            rec = arena.recs[(slot.rec_offset, slot.rec_gen)]
            if common_prefix(rec.tokens, prompt) >= p and window_allows_cut(
                strat.n_swa, rec.n_tokens, p
            ):
                usable.append(p)
    plan = plan_for(strat, arena, prompt, local)
    assert (plan.keep if plan.hit else 0) == max(usable, default=0)


@CHECK
@given(n=st.integers(1, 80), common=st.integers(0, 80), aligned=st.integers(0, 80))
def test_exact_context_keeps_only_whole_batches_it_computed_aligned(n, common, aligned):
    common = min(common, n)
    keep, cut = EXACT.keep_local(Local(common, -1, aligned), n)
    assert cut and keep % ALIGN == 0 and 0 <= keep <= min(common, aligned, n - 1)
    assert keep + ALIGN > min(common, aligned, n - 1)


@CHECK
@given(scene=scenes())
def test_exact_mode_with_n_batch_not_a_multiple_of_the_chunk_restores_nothing_and_says_so(
    scene,
) -> None:
    arena, prompt, _ = scene
    plan = plan_for(Exact(Rules(exact=True, align=6)), arena, prompt, 0)
    assert plan.hit is None and plan.problem and plan.problem[0] == "exact mode unavailable"


@pytest.mark.parametrize("strat", [EXACT, EXACT_WINDOW], ids=["exact", "exact-window"])
@CHECK
@given(n=st.integers(1, 120), reused=st.integers(0, 120))
def test_exact_checkpoints_are_boundaries_each_on_a_window_model_else_the_last(
    strat, n, reused
) -> None:
    reused = min(reused, n)
    cps = strat.checkpoints(n, reused, 0, CHUNK)
    last = (n - 1) // ALIGN * ALIGN
    assert cps.aligned == (last if reused % ALIGN == 0 else 0) and cps.min_new == 1
    wanted = list(range(last, reused, -ALIGN)) if strat.n_swa else [last] * (last > reused)
    assert cps.points == sorted(p for p in wanted if p >= CHUNK)


def test_exact_publishes_only_whole_batches_it_computed_aligned() -> None:
    assert EXACT.may_publish(16, aligned=16) and not EXACT.may_publish(16, aligned=8)
    assert not EXACT.may_publish(12, aligned=16)
    assert PLAIN.may_publish(13, aligned=0) and not Plain(Rules(publish=False)).may_publish(8, 0)


# ----------------------------------------------------------------------- publishing
@pytest.mark.parametrize("n_swa", [0, N_SWA])
@CHECK
@given(scene=scenes())
def test_coverage_counts_only_a_cached_state_that_can_stand_in_for_the_tokens(n_swa, scene):
    arena, tokens, _ = scene
    if arena.corrupt:
        return
    got = coverage(arena, tokens, chain_digests(ROOT, tokens, CHUNK), n_swa)
    k = longest(arena, tokens)
    if not k:
        assert got == 0
        return
    slot = arena.index[chain_digests(ROOT, tokens, CHUNK)[k - 1]]
    rec = arena.recs[(slot.rec_offset, slot.rec_gen)]
    c = common_prefix(rec.tokens, tokens)
    assert got == (c if window_allows_cut(n_swa, rec.n_tokens, c) else 0)


def test_min_tokens_setting_through_a_worker(supervisor, models):
    """SHMKV_MIN_TOKENS=600 in a real worker process: of a short prompt (fewer tokens)
    and a long one, only states of at least 600 tokens reach the arena."""
    from tests.support.llama_workers import SYSTEM, completion, run_worker

    short = " ".join(SYSTEM.split()[:60])
    got = run_worker(
        supervisor,
        models["seed0"],
        [completion(short), completion(SYSTEM)],
        env={"SHMKV_MIN_TOKENS": "600"},
    )
    short_n, long_n = (r["last"]["prompt_tokens"] for r in got["results"])
    assert 64 < short_n < 600 < long_n, (short_n, long_n)
    with supervisor.client(attach=False) as c:
        rows = c.ls()["entries"]
    assert rows and all(r["tokens"] >= 600 for r in rows), [r["tokens"] for r in rows]
