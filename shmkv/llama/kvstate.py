"""Sequence state in and out of a llama.cpp context: the mechanism under ``policy.py``.

Runs inside a worker, on the thread that holds the context's :class:`ContextGuard`;
the only module that calls llama.cpp's state API. :func:`apply` carries out a
restore plan: it leases the planned record, checks it (fingerprint, token
ids, payload checksum, the arena still whole, the lease still intact) and
hands the payload straight from the read-only mapping to
``llama_state_seq_set_data`` (a chunked record's assembled first into a buffer this
thread reuses, and its XXH3-64 checked, always); it decides nothing and counts nothing, but says
what happened. :func:`copy_out` copies the context's state into a memfd for
publishing; :func:`forget` makes the context start from scratch.
llama-cpp-python uses sequence 0 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as lc

from shmkv.core.arena import Hit, common_prefix
from shmkv.core.client import Blob, Client, Lease
from shmkv.core.errors import (
    ArenaCorruptError,
    LeaseLost,
    ModelMismatchError,
    NotFound,
    ShmkvError,
    StateRefused,
    UntrustedPublisher,
)
from shmkv.llama import compat
from shmkv.llama.policy import EVERYONE, Trust, context_allows_cut, window_allows_cut

log = logging.getLogger(__name__)

SEQ = 0
#: the id of a position filled by media (an image's or audio's embeddings) whose content
#: shmkv does not know: no token has it and no state holding it is published, so it
#: never matches (content-keyed media ids are below it: ``media.pseudo_ids``)
UNKNOWN = -1


class ContextGuard:
    """Who may touch one llama.cpp context now, and whether its cells are still a call's.

    A thread holds the guard while it runs a step of a call (restore, prefill, a
    token, a capture); the thread that holds it may enter it again. llama-cpp-python's
    server runs the steps of one stream on any thread of a pool, one at a time, under
    its model lock; a stream it abandons is closed later, by the garbage collector,
    on whatever thread that runs on, maybe while another call decodes. Such a late
    close asks :meth:`try_hold`, which refuses while anyone holds the guard (that
    thread included) and once another call has started (``generation``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        #: bumped by :meth:`begin`: each call, and each evaluation outside a call
        self.generation = 0

    def held_here(self) -> bool:
        """Whether the calling thread holds the guard."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> ContextGuard:
        me = threading.get_ident()
        if self._owner != me:
            self._lock.acquire()
            self._owner = me
        self._depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def begin(self) -> int:
        """(Holding the guard.) The context's cells now belong to a new call: its number."""
        self.generation += 1
        return self.generation

    def try_hold(self, generation: int) -> bool:
        """Hold the guard, without waiting, if nobody does and the cells are still those of
        call ``generation``; the caller then calls :meth:`release`."""
        if self.held_here() or not self._lock.acquire(blocking=False):
            return False
        if self.generation != generation:
            self._lock.release()
            return False
        self._owner, self._depth = threading.get_ident(), 1
        return True


class CutRefused(StateRefused):
    """llama.cpp refused to cut a restored state back: the model's states are restored
    whole only (a recurrent or hybrid model that :func:`whole_states_only` did not know)."""


def whole_states_only(model: lc.llama_model_p) -> str | None:
    """Why ``model``'s states can never be cut back to a shorter prefix (None: they can):
    a recurrent model (Mamba, RWKV) or a hybrid one (recurrent and attention layers)."""
    for kind in ("recurrent", "hybrid"):
        ask = getattr(lc, f"llama_model_is_{kind}", None)  # (bound since 0.3.1x)
        if ask is not None and ask(model):
            return kind
    return None


def pos_min(llm: llama_cpp.Llama) -> int:
    """The first position the context's KV cells still hold (-1: none)."""
    return int(lc.llama_memory_seq_pos_min(lc.llama_get_memory(llm.ctx), SEQ))


def forget(llm: llama_cpp.Llama, wipe: bool = False) -> None:
    """Go cold: llama-cpp-python prefills the whole prompt on its next call.

    ``wipe`` also clears the KV cells (after a restore left them half set).
    """
    if wipe:
        lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), False)
    llm.n_tokens = 0
    compat.requires_eval(llm)


@dataclass
class ContextState:
    """What a cache knows about its context's cells besides llama-cpp-python's own
    ``input_ids``/``n_tokens``; shared by the cache, its restorer (``restore.py``), its
    captures (``capture.py``) and its eval hook, changed only under the context guard."""

    #: the key root of the tenant whose calls computed the cells (None: mixed, a
    #: continuation across tenants: nothing of them is published)
    root: bytes | None
    #: leading tokens computed in whole, aligned batches (exact mode)
    aligned: int = 0
    #: leading rows of ``llm.scores`` that hold the logits of ``llm.input_ids`` (a
    #: restore sets tokens and cells, not the logits of those tokens)
    scores_valid: int = 0
    #: ``llm.n_tokens`` as shmkv last left it or saw it (its eval hook, a restore, a
    #: reset): positions past it were filled behind its back (an image: ``catch_up``)
    seen: int = 0

    def go_cold(self, llm: llama_cpp.Llama) -> None:
        """Forget the context's tokens: llama-cpp-python prefills the whole prompt."""
        forget(llm)
        self.aligned = 0
        self.seen = 0

    def wipe(self, llm: llama_cpp.Llama, root: bytes) -> None:
        """Clear the cells for the calls of the tenant whose key root is ``root``."""
        forget(llm, wipe=True)
        self.aligned = 0
        self.scores_valid = 0
        self.seen = 0
        self.root = root

    def cut_back(self, llm: llama_cpp.Llama, n_tokens: int) -> None:
        """Keep the context's first ``n_tokens`` positions only, cells included."""
        n = max(0, min(n_tokens, llm.n_tokens))
        lc.llama_memory_seq_rm(lc.llama_get_memory(llm.ctx), SEQ, n, -1)
        llm.n_tokens = n
        self.seen = min(self.seen, n)
        self.aligned = min(self.aligned, n)

    def catch_up(self, llm: llama_cpp.Llama) -> tuple[int, np.ndarray] | None:
        """Mark positions filled since shmkv last saw the context as media of unknown
        content (:data:`UNKNOWN`) and return where they start and the ids that were
        there (None: none). A chat handler decodes an image's embeddings straight into
        the context and advances ``n_tokens`` over them, never writing ``input_ids``:
        the ids there are an earlier call's, and would match text.
        """
        n, start = llm.n_tokens, self.seen
        self.seen = n
        if n <= start:
            return None  # (nothing new, or cut back: a prefix of what was seen)
        stale = np.array(llm.input_ids[start:n], dtype=np.int32)
        self._media(llm, start, n, UNKNOWN)
        return start, stale

    def declare(self, llm: llama_cpp.Llama, n_positions: int, ids: np.ndarray | int) -> None:
        """The last ``n_positions`` positions (up to ``n_tokens``) hold media whose ids are
        ``ids``; positions filled unseen before them are marked :data:`UNKNOWN`."""
        end = llm.n_tokens
        start = end - n_positions
        if n_positions <= 0 or start < self.seen:
            raise ValueError(
                f"media of {n_positions} positions ending at n_tokens={end} overlaps the "
                f"{self.seen} positions shmkv saw evaluated: advance n_tokens over the "
                "media's positions, then declare them, before any other eval"
            )
        if start > self.seen:
            self._media(llm, self.seen, start, UNKNOWN)
        self._media(llm, start, end, ids)
        self.seen = end

    def _media(self, llm: llama_cpp.Llama, start: int, end: int, ids: np.ndarray | int) -> None:
        llm.input_ids[start:end] = ids
        self.aligned = min(self.aligned, start)
        self.scores_valid = min(self.scores_valid, start)


@dataclass(frozen=True)
class Applied:
    """What applying a restore plan did: the tokens restored, or why none."""

    restored: int = 0
    #: (kind, message): the message only, never the exception, whose traceback would
    #: tie the caller's frame (and the arena view in it) into a reference cycle that
    #: keeps a replaced arena mapped until the cyclic GC runs
    failure: tuple[str, str] | None = None
    #: the failure is a restore failure (counted, and reported to the supervisor)
    failed: bool = False
    #: the record failed our checks; the supervisor was asked to re-check it
    corrupt: bool = False
    #: the record was evicted between the lookup and the lease
    evicted: bool = False
    #: llama.cpp refused the state (it passed our checks): a miss, nobody is told
    refused: bool = False
    #: the record's publisher is not one this worker trusts (a miss, not a failure)
    untrusted: bool = False
    #: llama.cpp refused to cut the state back: this context takes whole states only
    cannot_cut: bool = False


def apply(
    llm: llama_cpp.Llama,
    reader: Client,
    hit: Hit,
    prompt: np.ndarray,
    *,
    chunk: int,
    local: int,
    keep: int,
    n_swa: int,
    fingerprint: bytes,
    verify: bool = True,
    trust: Trust = EVERYONE,
) -> Applied:
    """Lease the record behind ``hit`` and :func:`load` it; never raises a ShmkvError."""
    try:
        lease = reader.acquire(hit)
    except NotFound:
        return Applied(evicted=True)
    except ArenaCorruptError as e:
        _suspect(reader, hit)
        return Applied(failure=("corrupt record", str(e)), failed=True, corrupt=True)
    except ShmkvError as e:
        return Applied(failure=("supervisor unavailable", str(e)))
    restored = 0
    try:
        try:
            restored = load(
                llm,
                lease,
                prompt,
                need=hit.chunks * chunk,
                local=local,
                keep=keep,
                n_swa=n_swa,
                fingerprint=fingerprint,
                verify=verify,
                trust=trust,
            )
        finally:
            lease.finish()  # (tokens_restored: in the ledger's reported totals)
    except UntrustedPublisher as e:
        return Applied(failure=("untrusted publisher", str(e)), untrusted=True)
    except LeaseLost as e:  # (the bytes may have changed under the copy: not a bad record)
        # a lease void because its connection went (a supervisor restart) is not a
        # revocation: the supervisor was unavailable for that restore
        kind = "supervisor unavailable" if lease.lost else "lease revoked"
        return Applied(failure=(kind, str(e)))
    except CutRefused as e:  # (a model whose states are whole only: not a bad record)
        return Applied(failure=("state cannot be cut", str(e)), refused=True, cannot_cut=True)
    except StateRefused as e:  # (a state made for another context: not a bad record)
        return Applied(failure=("state refused", str(e)), refused=True)
    except ArenaCorruptError as e:
        _suspect(reader, hit)
        return Applied(failure=("corrupt record", str(e)), failed=True, corrupt=True)
    except ModelMismatchError as e:
        return Applied(failure=("model mismatch", str(e)), failed=True)
    except ShmkvError as e:
        return Applied(failure=("cache error", str(e)), failed=True)
    return Applied(restored=restored)


def _suspect(reader: Client, hit: Hit) -> None:
    """Ask the supervisor to re-check (and drop) a record that failed our checks."""
    try:
        reader.request({"op": "suspect", "offset": hit.slot.rec_offset, "gen": hit.slot.rec_gen})
    except ShmkvError as e:
        log.debug("suspect report failed: %s", e)


def load(
    llm: llama_cpp.Llama,
    lease: Lease,
    prompt: np.ndarray,
    *,
    need: int,
    local: int,
    keep: int,
    n_swa: int,
    fingerprint: bytes,
    verify: bool = True,
    trust: Trust = EVERYONE,
) -> int:
    """Restore the leased record into the context if it gives more than ``local`` tokens.

    ``need``: the leading tokens its key promised; ``keep``: keep at most these.
    Returns the tokens now restored (0: not worth it, the context untouched). Raises
    UntrustedPublisher (a record of a publisher ``trust`` does not allow, never
    restored), ModelMismatchError, ArenaCorruptError, StateRefused (llama.cpp does
    not take the state) or LeaseLost; a context it touched is then cold. The lease
    is released (``finish``) once the state is in.
    """
    rec = lease.record
    if not trust.allows(rec.publisher):
        raise UntrustedPublisher(
            f"a cached state published by uid {rec.publisher}, which this worker does not "
            f"trust, was skipped: add that user to --trust-publishers (SHMKV_TRUST_PUBLISHERS) "
            f"to restore its states"
        )
    if lease.fingerprint() != fingerprint:
        raise ModelMismatchError("cached blob belongs to another model/context setup")
    cached = lease.tokens()
    if rec.n_tokens < need or not np.array_equal(cached[:need], prompt[:need]):
        raise ArenaCorruptError("cached token ids do not match their key digest")
    common = min(common_prefix(cached, prompt), keep)
    cut = min(common, len(prompt) - 1)
    if common <= local or not window_allows_cut(n_swa, rec.n_tokens, cut):
        return 0  # (nothing gained, or a window state that cannot be cut this far)
    lease.view.check()
    with contextlib.ExitStack() as buffer:
        if rec.chunked:  # (assembled into the process's buffer, held until set_data is done)
            address = buffer.enter_context(lease.view.assembled(rec)).ctypes.data
        else:
            if verify and not lease.view.verify_payload(rec):
                raise ArenaCorruptError("blob payload fails its checksum")
            address = lease.address
        ptr = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8))
        mem = lc.llama_get_memory(llm.ctx)
        # Start from an empty cache with its head at cell 0, as a cold prefill does, so
        # the restored cells sit where a prefill would have put them.
        lc.llama_memory_clear(mem, False)
        llm.n_tokens = 0
        try:
            n = lc.llama_state_seq_set_data(llm.ctx, ptr, rec.payload_len, SEQ)
            buffer.close()  # (llama.cpp copied it: the buffer is another thread's now)
            if n != rec.payload_len:
                raise StateRefused(
                    f"llama_state_seq_set_data accepted {n} of {rec.payload_len} bytes: the "
                    "state does not fit this context (published by a worker with other "
                    "settings?)"
                )
            if common < rec.n_tokens and not lc.llama_memory_seq_rm(mem, SEQ, common, -1):
                raise CutRefused(
                    f"llama.cpp cannot cut a restored state of {rec.n_tokens} tokens back to "
                    f"{common} (a recurrent or hybrid model?): this worker restores whole "
                    "states only from now on, checkpoints at chat message boundaries and "
                    "before a prompt's end"
                )
            if not context_allows_cut(n_swa, pos_min(llm), cut):  # (planning prevents this)
                raise ModelMismatchError(
                    "a restored sliding-window or recurrent state lacks what its cut needs"
                )
            if not lease.finish():  # (tokens_restored: in the ledger's reported totals)
                raise LeaseLost(
                    "a read lease was revoked, or its connection lost, during the restore"
                )
        except BaseException:
            forget(llm, wipe=True)
            raise
    llm.input_ids[:common] = prompt[:common]
    llm.n_tokens = common
    compat.requires_eval(llm)
    return common


def _recurrent_calls() -> tuple[int, Any, Any] | None:
    """(flag, get_size_ext, get_data_ext) where this llama-cpp-python binds them: optional,
    not in ``compat.FUNCTIONS`` (a version without them copies a hybrid's checkpoints
    whole, as before)."""
    flag = getattr(lc, "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", None)
    size = getattr(lc, "llama_state_seq_get_size_ext", None)
    data = getattr(lc, "llama_state_seq_get_data_ext", None)
    return None if flag is None or size is None or data is None else (flag, size, data)


def can_copy_recurrent() -> bool:
    """Whether :func:`copy_recurrent` can copy anything with this llama-cpp-python."""
    return _recurrent_calls() is not None


def copy_recurrent(llm: llama_cpp.Llama, n_tokens: int) -> bytes | None:
    """A hybrid's recurrent state alone (``llama_state_seq_get_data_ext`` with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the magic, the seq_id, the recurrent cache's
    state, no attention cell), a small copy whatever the prompt's length; None unless the
    KV holds exactly ``n_tokens`` tokens and this llama-cpp-python has the call."""
    calls = _recurrent_calls()
    if calls is None:
        return None
    flag, get_size, get_data = calls
    if lc.llama_memory_seq_pos_max(lc.llama_get_memory(llm.ctx), SEQ) + 1 != n_tokens:
        return None
    size = int(get_size(llm.ctx, SEQ, flag))
    if size <= 0:
        return None
    buf = bytearray(size)
    arr = (ctypes.c_uint8 * size).from_buffer(buf)
    got = get_data(llm.ctx, arr, size, SEQ, flag)
    del arr
    return bytes(buf) if got == size else None


def copy_out(llm: llama_cpp.Llama, n_tokens: int, writer: Client) -> Blob | None:
    """The context's state, copied into a memfd blob; None unless the KV holds exactly
    ``n_tokens`` tokens. Raises ShmkvError or OSError."""
    if lc.llama_memory_seq_pos_max(lc.llama_get_memory(llm.ctx), SEQ) + 1 != n_tokens:
        return None
    size = lc.llama_state_seq_get_size(llm.ctx, SEQ)
    if size <= 0:
        return None

    def fill(addr: int, sz: int) -> None:
        got = lc.llama_state_seq_get_data(
            llm.ctx, ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), sz, SEQ
        )
        if got != sz:
            raise ShmkvError(f"llama_state_seq_get_data wrote {got} of {sz} bytes")

    return writer.prepare(size, fill)
