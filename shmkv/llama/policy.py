"""Restore planning: which cached state a prompt restores, and which states it publishes.

Runs inside a worker, but touches neither llama.cpp nor a socket. It reads a
view of the arena (the index and records' token ids, lease-free) and learns
about a chunk prefix's other records only through the ``owners`` callable it
is given (the supervisor's ``owners`` op in a worker, a dict in a test). So it
is a function of (view, prompt, the prompt's digest chain, the context's own
state) and is tested with hypothesis against a fake view. What it plans is
checked again under a lease before any byte reaches llama.cpp (``kvstate.py``).

Every strategy plans only with records of publishers the worker trusts
(:class:`Trust`): another's record is skipped like one that does not fit, and
counted (``Plan.untrusted``).

Three strategies, chosen once per cache from its :class:`Rules`:

* :class:`Plain`: a state can be cut back anywhere; restore the longest cached
  prefix.
* :class:`SlidingWindow`: a sliding-window layer keeps only the last ``n_swa``
  positions, so a state can be cut back only within its window; otherwise it
  must be restored whole. Checkpoints are published where prompts diverge, and
  where a chat's messages start (boundaries the caller hints, ``boundaries.py``).
  A recurrent or hybrid model (Mamba, Qwen 3.5, Jamba, ...: ``n_swa`` is
  :data:`WHOLE`) takes the same path: its states are never cut back.
* :class:`Exact`: restore only at multiples of ``n_batch``, from states computed
  in whole batches, so that a hit repeats a cold run's batches bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import numpy as np

from shmkv.core.arena import Hit, Slot, common_prefix
from shmkv.core.errors import ArenaCorruptError

#: how many shorter chunk prefixes a sliding-window model tries when the longest cannot be cut
SWA_MAX_PROBES = 256
#: publish a divergence checkpoint only if it saves later prompts at least this many tokens
SWA_MIN_GAIN = 16
#: most checkpoints one prefill publishes at chat message boundaries (each is a state capture)
MAX_BOUNDARY_CHECKPOINTS = 2
#: most checkpoints one prefill of a hybrid publishes every ``checkpoint_every`` tokens (each
#: holds a recurrent state in the arena: megabytes on a real model)
MAX_INTERVAL_CHECKPOINTS = 4

#: the ``n_swa`` of a model whose states cannot be cut back at all: a recurrent layer (Mamba,
#: a hybrid's delta-net or SSM layers) keeps one summary of every token so far, not one
#: cell per position, and llama.cpp refuses to cut it (``llama_memory_seq_rm``)
WHOLE = -1

#: the supervisor's ``owners``: (digest, prompt) -> [(offset, gen, n_tokens, tokens matched)],
#: of the records of trusted publishers only
Owners = Callable[[bytes, np.ndarray], Sequence[tuple[int, int, int, int]]]


@dataclass(frozen=True)
class Trust:
    """Whose records a worker restores: the publisher uids it trusts (None: anyone the
    supervisor lets publish)."""

    uids: frozenset[int] | None = None

    def allows(self, uid: int) -> bool:
        return self.uids is None or uid in self.uids


EVERYONE = Trust()


class ArenaReader(Protocol):
    """The lease-free reads planning needs (``shmkv.core.arena.ArenaView`` has them)."""

    def probe(self, digest: bytes) -> Slot | None: ...

    def find_longest(self, digests: Sequence[bytes]) -> tuple[int, Slot] | None: ...

    def peek(self, offset: int, gen: int) -> tuple[Any, np.ndarray]: ...


# ------------------------------------------------------------ window rules
# A sliding-window layer (Gemma 2/3, Mistral, gpt-oss, ...) only ever attends to
# the last n_swa positions, and llama.cpp serializes only those: a state of n
# tokens holds positions n - n_swa .. n - 1 of its window layers. Cutting such a
# state back to `keep` tokens and evaluating from there needs positions
# keep - n_swa + 1 .. keep - 1, which it no longer has: llama.cpp would quietly
# attend to fewer tokens and the output would differ from a cold run. So a
# state may be cut back only as far as its window allows (one token for a long
# state; llama-cpp-python always re-evaluates the last prompt token), and
# otherwise only restored whole. The same holds for a context's own cells after
# a restore. llama.cpp's server makes the same check with seq_pos_min. A recurrent
# state (n_swa WHOLE) is never cut: only a state of at most `keep` tokens is usable.
def window_allows_cut(n_swa: int, n_state: int, keep: int) -> bool:
    """Whether a restored state of ``n_state`` tokens can be cut back to ``keep``."""
    if keep >= n_state:
        return True
    if n_swa == WHOLE:
        return False
    return n_swa <= 0 or max(0, n_state - n_swa) <= max(0, keep - n_swa + 1)


def context_allows_cut(n_swa: int, pos_min: int, keep: int) -> bool:
    """Whether a context whose first held position is ``pos_min`` can evaluate after ``keep``.

    (llama.cpp reports a recurrent or hybrid context's last position as its first: it
    holds no earlier one it could go back to.)
    """
    if keep <= 0:
        return True
    if n_swa == WHOLE:
        return pos_min < keep
    return n_swa <= 0 or pos_min <= max(0, keep - n_swa + 1)


class Peek(NamedTuple):
    """A lease-free look at a record."""

    n_tokens: int  #: its tokens
    common: int  #: how many of the prompt's tokens it matches
    trusted: bool  #: published by a uid the worker trusts


def peek(view: ArenaReader, slot: Slot, prompt: np.ndarray, trust: Trust = EVERYONE) -> Peek | None:
    """A lease-free look at a record; None if it does not parse (the lease path re-checks
    whatever is then used)."""
    try:
        # (read without the mapping: the record may be freed and its pages punched meanwhile)
        rec, tokens = view.peek(slot.rec_offset, slot.rec_gen)
        trusted = trust.uids is None or trust.allows(rec.publisher)
        return Peek(rec.n_tokens, common_prefix(tokens, prompt), trusted)
    except (ArenaCorruptError, ValueError):
        return None


def coverage(
    view: ArenaReader,
    tokens: np.ndarray,
    digests: Sequence[bytes],
    n_swa: int,
    trust: Trust = EVERYONE,
) -> int:
    """How many leading ``tokens`` a record in the arena already holds (a hint for publishing).

    A record of an untrusted publisher covers nothing: this worker publishes its own.
    Raises what ``view.find_longest`` raises.
    """
    found = view.find_longest(digests)
    looked = None if found is None else peek(view, found[1], tokens, trust)
    if looked is None or not looked.trusted:
        return 0
    # a longer sliding-window state that cannot be cut back covers nothing
    return looked.common if window_allows_cut(n_swa, looked.n_tokens, looked.common) else 0


# ------------------------------------------------------------ inputs, outputs
@dataclass(frozen=True)
class Rules:
    """What planning knows about the worker's model, context and settings."""

    n_swa: int = 0  #: sliding-window width (0: none; WHOLE: states are never cut back)
    exact: bool = False
    align: int = 1  #: exact mode: n_batch, the only places a state is restored or published
    min_tokens: int = 0  #: shortest prompt state worth publishing (at least one chunk)
    publish: bool = True
    checkpoint_tail: int = 0  #: publish a state this many tokens before a new prompt's end
    #: a hybrid's checkpoints (their recurrent state alone): also every this many tokens
    #: of a new prompt (n_batch: where its prefill's batches end anyway; 0: none)
    checkpoint_every: int = 0

    def min_publish(self, chunk: int) -> int:
        return max(self.min_tokens, chunk)


@dataclass(frozen=True)
class Local:
    """The worker's own context as planning sees it."""

    common: int  #: leading prompt tokens the context already holds
    pos_min: int = -1  #: first position its KV cells still hold (-1: none; sliding windows)
    aligned: int = 0  #: exact mode: leading tokens computed in whole, aligned batches


@dataclass(frozen=True)
class Lookup:
    """One prompt's lookup in the arena: what every strategy plans from."""

    view: ArenaReader  #: lease-free reads of the arena
    prompt: np.ndarray
    chunk: int  #: the arena's chunk size, in tokens
    digests: Sequence[bytes]  #: the prompt's digest chain
    hit: Hit | None  #: the longest indexed chunk prefix of the prompt
    local: int  #: what the context keeps of its own
    owners: Owners  #: the records of a chunk prefix, of trusted publishers only
    trust: Trust = EVERYONE


@dataclass(frozen=True)
class Plan:
    """What to restore for one prompt.

    ``hit`` is the record to lease (None: restore nothing), of which at most
    ``keep`` tokens are kept. The rest tells the caller what it learned on the way.
    """

    hit: Hit | None = None
    keep: int = 0
    #: how far the prompt matches ``hit``'s record, when already looked at
    known: int | None = None
    #: publish the state of this many prompt tokens during the prefill (0: none)
    checkpoint: int = 0
    #: nothing in the arena helped and the context holds less than a chunk
    miss: bool = False
    #: the longest cached prefix was a sliding-window state this prompt cannot cut back
    window_unusable: bool = False
    #: (kind, message) of a setup problem to log once
    problem: tuple[str, str] | None = None
    #: records of untrusted publishers met (and skipped) on the way
    untrusted: int = 0


@dataclass(frozen=True)
class Checkpoints:
    """States to publish while prefilling a prompt: at each of ``points`` (ascending)."""

    points: list[int]
    min_new: int = 0  #: publish only if it adds this many tokens to what is cached
    aligned: int | None = None  #: exact mode: the context's leading tokens in whole batches


# ------------------------------------------------------------ strategies
class Strategy:
    """What every strategy shares: the context's own tokens, the lease-or-not decision."""

    #: whether checkpoints at chat message boundaries help (states that cannot be cut back)
    wants_boundaries = False

    @property
    def cuts_back(self) -> bool:
        """Whether a longer state is of use cut back to any shorter prefix (no sliding
        window, no recurrent layer): the remote tier then fetches records that go on
        past where they part from the prompt."""
        return self.rules.n_swa == 0

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.n_swa = rules.n_swa

    def keep_local(self, local: Local, n_prompt: int) -> tuple[int, bool]:
        """How many of its own tokens the context keeps, and whether to cut it to that.

        A context restored from a window state lacks the window before its cut: it
        keeps nothing then (llama-cpp-python would otherwise reuse those tokens).
        """
        keep = local.common
        if keep and not context_allows_cut(self.n_swa, local.pos_min, min(keep, n_prompt - 1)):
            return 0, True
        return keep, False

    def plan(self, lookup: Lookup) -> Plan:
        """The record to restore for the lookup's prompt, given its longest indexed
        prefix ``lookup.hit``.

        ``lookup.owners`` (which lists trusted publishers' records only) is asked at most
        once, and only for sliding windows or when the indexed record's publisher is not
        trusted; such a record is never planned (``lookup.trust``).
        """
        view, prompt, chunk = lookup.view, lookup.prompt, lookup.chunk
        local, trust = lookup.local, lookup.trust
        plan = self.choose(lookup)
        hit = plan.hit
        if hit is None or hit.chunks * chunk + chunk <= local:
            return replace(plan, hit=None, miss=hit is None and local < chunk)
        # a lease-free peek: skip the round trip when the record cannot beat `local`
        # (token ids contradicting the digests that found them are corruption: the lease
        # path detects and counts that, so do not skip it)
        known = plan.known
        if known is None:
            looked = peek(view, hit.slot, prompt, trust)
            if looked is not None and not looked.trusted:  # (a strategy that did not look)
                return replace(plan, hit=None, untrusted=plan.untrusted + 1, miss=local < chunk)
            known = None if looked is None else looked.common
        if known is not None and hit.chunks * chunk <= known <= local:
            return replace(plan, hit=None, known=known)
        return replace(plan, known=known)

    def choose(self, lookup: Lookup) -> Plan:
        """The strategy's own choice of record, before the lease-or-not decision."""
        raise NotImplementedError

    def trusted_instead(self, lookup: Lookup, hit: Hit) -> Plan:
        """The record ``hit`` points at is an untrusted publisher's: the best trusted one.

        The other records of its chunk prefix first (``owners``: one round trip), then
        shorter chunk prefixes by lease-free peeks. The index points a chunk prefix at
        one record, which may be anyone's; this worker's own copy is then beside it.
        """
        view, prompt, chunk, digests = lookup.view, lookup.prompt, lookup.chunk, lookup.digests
        trust = lookup.trust
        top, n = hit.chunks, len(prompt)
        best, best_common = None, 0
        for off, gen, _n_rec, c in lookup.owners(digests[top - 1], prompt):
            if c >= top * chunk and c > best_common:
                best, best_common = Hit(top, Slot(digests[top - 1], off, gen, top)), c
        if best is not None:
            return Plan(hit=best, keep=n, known=best_common, untrusted=1)
        skipped = {(hit.slot.rec_offset, hit.slot.rec_gen)}
        for k in range(top - 1, max(0, top - 1 - SWA_MAX_PROBES), -1):
            slot = view.probe(digests[k - 1])
            if slot is None or (slot.rec_offset, slot.rec_gen) in skipped:
                continue
            looked = peek(view, slot, prompt, trust)
            if looked is None or looked.trusted:  # (corrupt-looking: the lease path tells)
                known = None if looked is None else looked.common
                return Plan(hit=Hit(k, slot), keep=n, known=known, untrusted=len(skipped))
            skipped.add((slot.rec_offset, slot.rec_gen))
        return Plan(keep=n, untrusted=len(skipped))

    def may_publish(self, n_tokens: int, aligned: int) -> bool:
        """Whether a state of ``n_tokens`` may be published at all."""
        return self.rules.publish

    def checkpoints(
        self,
        n_prompt: int,
        reused: int,
        divergence: int,
        chunk: int | None,
        boundaries: Sequence[int] = (),
    ) -> Checkpoints:
        """States to publish while prefilling after ``reused`` tokens (``boundaries``: where
        the prompt's chat messages start, a hint)."""
        return Checkpoints([])


class Plain(Strategy):
    """A state can be cut back to any shorter prefix: the longest cached prefix wins."""

    def choose(self, lookup: Lookup) -> Plan:
        view, prompt, chunk = lookup.view, lookup.prompt, lookup.chunk
        hit, local, trust = lookup.hit, lookup.local, lookup.trust
        n = len(prompt)
        if hit is None or trust.uids is None or hit.chunks * chunk + chunk <= local:
            return Plan(hit=hit, keep=n)
        looked = peek(view, hit.slot, prompt, trust)
        if looked is None or looked.trusted:
            return Plan(hit=hit, keep=n, known=None if looked is None else looked.common)
        return self.trusted_instead(lookup, hit)


class SlidingWindow(Strategy):
    """States restored whole or cut within their window; checkpoints where prompts part.

    With ``n_swa`` :data:`WHOLE` (recurrent and hybrid models) there is no window: only
    states of at most the reused length are restored, so the checkpoints are all there is.
    """

    wants_boundaries = True

    def choose(self, lookup: Lookup) -> Plan:
        """The best record this model can restore, and where the prompt diverges.

        1. The record the longest chunk prefix points at, if the prompt runs to its
           end (all but its last token): nothing can beat it.
        2. Else every record under that prefix (``owners``, one round trip): the one
           the prompt matches furthest among those it can restore whole, and how far
           the prompt goes along with any of them (where a checkpoint would help).
        3. Else shorter chunk prefixes, whose slots point at the records ending in
           them (the checkpoints published near a prompt's end), by lease-free peeks.

        A record of an untrusted publisher is skipped like one that does not fit, and
        tells nothing about where the prompt diverges.
        """
        view, prompt, chunk, digests = lookup.view, lookup.prompt, lookup.chunk, lookup.digests
        hit, local, owners, trust = lookup.hit, lookup.local, lookup.owners, lookup.trust
        n = len(prompt)
        if hit is None or hit.chunks * chunk + chunk <= local:
            return Plan(hit=hit, keep=n)
        untrusted = 0

        def fits(slot: Slot, k: int) -> tuple[bool | None, int]:
            """(restorable whole? None if it looks corrupt, tokens matched)."""
            nonlocal untrusted
            looked = peek(view, slot, prompt, trust)
            if looked is not None and not looked.trusted:
                untrusted += 1
                return False, 0
            if looked is None or looked.common < k * chunk:  # (ids contradicting digests)
                return None, 0
            whole = window_allows_cut(self.n_swa, looked.n_tokens, min(looked.common, n - 1))
            return whole, looked.common

        top = hit.chunks
        ok, common = fits(hit.slot, top)
        if ok is None or (ok and common >= n - 1):
            return Plan(hit=hit, keep=n, known=common)  # (corrupt-looking: the lease path
        diverge = common  # detects and counts it)
        window = not untrusted  # (the top record is unusable for its window, not its publisher)
        best, best_common = (hit, common) if ok else (None, 0)
        for off, gen, n_rec, c in owners(digests[top - 1], prompt):
            diverge = max(diverge, c)
            if (
                c > best_common
                and c >= top * chunk
                and window_allows_cut(self.n_swa, n_rec, min(c, n - 1))
            ):
                best, best_common = Hit(top, Slot(digests[top - 1], off, gen, top)), c
        unusable = best is None
        window_unusable = unusable and window
        if unusable:
            rejected = {(hit.slot.rec_offset, hit.slot.rec_gen)}
            for k in range(top - 1, max(0, top - 1 - SWA_MAX_PROBES), -1):
                slot = view.probe(digests[k - 1])
                if slot is None or (slot.rec_offset, slot.rec_gen) in rejected:
                    continue
                ok, common = fits(slot, k)
                if ok is None or ok:
                    best, best_common = Hit(k, slot), common
                    break
                rejected.add((slot.rec_offset, slot.rec_gen))
                diverge = max(diverge, common)
        return Plan(
            hit=best,
            keep=n,
            known=best_common,
            window_unusable=window_unusable,
            checkpoint=self._divergence(diverge, max(local, best_common), n, chunk),
            untrusted=untrusted,
        )

    def _divergence(self, diverge: int, have: int, n_prompt: int, chunk: int) -> int:
        """Publish the state of the first ``diverge`` tokens during this prefill (0: no).

        The prompt matched a cached one up to ``diverge`` tokens, but that state
        cannot be cut back; a state of exactly that prefix is restored whole by every
        later prompt that shares it (a shared system prompt with different questions).
        """
        if (
            diverge >= have + SWA_MIN_GAIN
            and self.rules.publish
            and have < diverge < n_prompt - 1
            and diverge >= self.rules.min_publish(chunk)
        ):
            return diverge
        return 0

    def tail_checkpoint(self, n_prompt: int, have: int, chunk: int | None) -> int:
        """Where to publish a state a little before the end of a new prompt (0: nowhere).

        Before any divergence is known: a prompt whose last part differs (a new
        question after the same system prompt or document) then restores this
        state instead of prefilling from the start.
        """
        tail = self.rules.checkpoint_tail
        if tail <= 0 or chunk is None or not self.rules.publish:
            return 0
        at = n_prompt - tail
        if (
            at < have + SWA_MIN_GAIN
            or at < self.rules.min_publish(chunk)
            or window_allows_cut(self.n_swa, n_prompt, at)
        ):
            return 0  # (a state a few tokens past one just restored helps nobody)
        return at

    def boundary_checkpoints(
        self, n_prompt: int, have: int, chunk: int | None, boundaries: Sequence[int]
    ) -> list[int]:
        """Which hinted message boundaries get a checkpoint (ascending, at most
        ``MAX_BOUNDARY_CHECKPOINTS``): each must save a later prompt ``SWA_MIN_GAIN``
        tokens over what this one restored and over the boundary before it, be worth
        publishing at all, and lie where the prompt's own state cannot stand in for it.
        The first ones win (a system message is shared by more prompts than a history).
        """
        if chunk is None or not self.rules.publish:
            return []
        out: list[int] = []
        for b in sorted(set(boundaries)):
            if len(out) == MAX_BOUNDARY_CHECKPOINTS:
                break
            if (
                b < have + SWA_MIN_GAIN
                or (out and b < out[-1] + SWA_MIN_GAIN)
                or b >= n_prompt - 1
                or b < self.rules.min_publish(chunk)
                or window_allows_cut(self.n_swa, n_prompt, b)
            ):
                continue
            out.append(b)
        return out

    def interval_checkpoints(
        self, n_prompt: int, have: int, chunk: int | None, taken: Sequence[int]
    ) -> list[int]:
        """A hybrid's checkpoints every ``checkpoint_every`` tokens of the prompt past what
        this one restored and before its ``checkpoint_tail`` (ascending, at most
        ``MAX_INTERVAL_CHECKPOINTS``, the first ones:
        the more prompts share a prefix, the shorter it is), none close to one ``taken``
        already: a later prompt that parts from this one anywhere restores the one below
        where it parts, not only at a message boundary, the divergence or the tail."""
        every = self.rules.checkpoint_every
        if every <= 0 or chunk is None or not self.rules.publish:
            return []
        out: list[int] = []
        # (none within the tail: the tail checkpoint stands for them, and one a few tokens
        # before a prompt's end is a copy of that prompt's own state in all but name)
        end = n_prompt - max(self.rules.checkpoint_tail, SWA_MIN_GAIN)
        for p in range((have // every + 1) * every, end, every):
            if len(out) == MAX_INTERVAL_CHECKPOINTS:
                break
            if (
                p >= have + SWA_MIN_GAIN
                and p >= self.rules.min_publish(chunk)
                and all(abs(p - t) >= SWA_MIN_GAIN for t in taken)
            ):
                out.append(p)
        return out

    def checkpoints(
        self,
        n_prompt: int,
        reused: int,
        divergence: int,
        chunk: int | None,
        boundaries: Sequence[int] = (),
    ) -> Checkpoints:
        """The message boundaries worth it, the divergence or else the tail checkpoint,
        and a hybrid's every ``checkpoint_every`` tokens.

        A divergence close to a boundary gives way to it. So does a tail checkpoint that
        lies before the last boundary (or close after it): later prompts that share that
        much share the boundary, which every prompt with the same messages restores.
        """
        marks = self.boundary_checkpoints(n_prompt, reused, chunk, boundaries)
        at = divergence
        if at:
            if any(abs(at - b) < SWA_MIN_GAIN for b in marks):
                at = 0
        else:
            at = self.tail_checkpoint(n_prompt, reused, chunk)
            if marks and at < marks[-1] + SWA_MIN_GAIN:
                at = 0
        points = set(marks) | ({at} if reused < at < n_prompt - 1 else set())
        points |= set(self.interval_checkpoints(n_prompt, reused, chunk, sorted(points)))
        return Checkpoints(sorted(points), min_new=0)


class Exact(Strategy):
    """Restore and publish only at multiples of n_batch (``--exact``).

    A cold run evaluates a prompt in batches [0, B), [B, 2B), ...; a state cut at a
    multiple of B and computed in those same batches (exact-mode states are: they
    live under their own keys), followed by the rest evaluated from there, repeats
    the cold run's batches exactly, so its numbers are the same bit for bit.
    """

    def keep_local(self, local: Local, n_prompt: int) -> tuple[int, bool]:
        keep, _ = super().keep_local(local, n_prompt)
        align = self.rules.align
        return min(keep, local.aligned, n_prompt - 1) // align * align, True

    def choose(self, lookup: Lookup) -> Plan:
        """The longest multiple of n_batch that a cached state (of a trusted publisher)
        gives."""
        view, prompt, chunk, digests = lookup.view, lookup.prompt, lookup.chunk, lookup.digests
        hit, local, owners, trust = lookup.hit, lookup.local, lookup.owners, lookup.trust
        align = self.rules.align
        if align % chunk:
            return Plan(
                problem=(
                    "exact mode unavailable",
                    f"n_batch {align} is not a multiple of the arena's chunk_tokens {chunk}",
                )
            )
        if hit is None:
            return Plan()
        p = min(hit.chunks * chunk, len(prompt) - 1) // align * align
        untrusted = 0
        while p > local:
            k = p // chunk
            slot = hit.slot if p == hit.chunks * chunk else view.probe(digests[k - 1])
            if slot is not None:
                looked = peek(view, slot, prompt, trust)
                if looked is None:  # the lease path detects and counts it
                    return Plan(hit=Hit(k, slot), keep=p, untrusted=untrusted)
                if not looked.trusted:  # another record of this prefix may be trusted
                    untrusted += 1
                    for off, gen, n_rec, c in owners(digests[k - 1], prompt):
                        if c >= p and window_allows_cut(self.n_swa, n_rec, p):
                            found = Hit(k, Slot(digests[k - 1], off, gen, k))
                            return Plan(hit=found, keep=p, untrusted=untrusted)
                elif looked.common >= p and window_allows_cut(self.n_swa, looked.n_tokens, p):
                    return Plan(hit=Hit(k, slot), keep=p, untrusted=untrusted)
            p -= align
        return Plan(untrusted=untrusted)

    def may_publish(self, n_tokens: int, aligned: int) -> bool:
        """Only states of whole batches, computed as a cold run computes them."""
        return self.rules.publish and n_tokens % self.rules.align == 0 and n_tokens <= aligned

    def checkpoints(
        self,
        n_prompt: int,
        reused: int,
        divergence: int,
        chunk: int | None,
        boundaries: Sequence[int] = (),
    ) -> Checkpoints:
        """Prefill batch by batch, publishing the state at batch boundaries.

        Only these states are published in exact mode (a prompt's own end is not a
        boundary a longer prompt's cold run shares). A model that can cut a state
        back needs only the last boundary; a sliding-window or recurrent one needs each.
        """
        align = self.rules.align
        last = (n_prompt - 1) // align * align  # the start of a cold run's last batch
        # once prefilled from an aligned point, everything before `last` was computed in
        # the cold run's own batches (the rest and the completion were not)
        aligned = last if reused % align == 0 else 0
        if chunk is None or not self.rules.publish or last <= reused or align % chunk:
            return Checkpoints([], min_new=1, aligned=aligned)
        wanted = range(last, reused, -align) if self.n_swa else [last]
        points = [b for b in sorted(wanted) if b >= self.rules.min_publish(chunk)]
        return Checkpoints(points, min_new=1, aligned=aligned)


def strategy(rules: Rules) -> Strategy:
    """The strategy for a model and its settings."""
    if rules.exact:
        return Exact(rules)
    if rules.n_swa:  # (a window, or WHOLE)
        return SlidingWindow(rules)
    return Plain(rules)
