"""Adopting the arena a stopped or killed supervisor left, so the cache survives a restart.

Runs in the supervisor, at start, while it holds the name's lock (so no live
supervisor owns the file); :func:`remove_left` runs in ``shmkv clear``.
:func:`open_leftover` opens and checks the file itself: a plain file of our uid,
mode 0600 or 0640 (nobody else could have written it), of this format and of
the geometry the settings ask for, as large as its header says. :class:`Adoption` then
fills a fresh :class:`~shmkv.supervisor.store.Store` from it, while the supervisor
already answers (``--adopt-wait``): the records that index slots name, each
checked as a worker checks it (bounds, header, metadata and payload checksums: a
whole record's XXH3-64, each chunk's XXH3-128 once, its chained digests against its key
and the slots that name it, its generation and creation time in a range this supervisor
can go on from), and nothing else.

What a put had not finished when its supervisor died is never adopted. A put
writes its payload, then token ids, fingerprint and header (with the metadata
checksum) and only then points index slots at the record (``put.py``), and an
eviction takes a record out of every slot before it clears its header and frees
its space: so a slot names only a record whose bytes were complete, a slot
caught mid-write has an odd seqlock word and is skipped, and the checksums catch
bytes damaged since. The data region is never scanned for record headers: a
publisher chooses its payload's bytes and could plant a header in them that
claims another publisher's uid.

Workers still attached to the dead supervisor reattach as after any restart:
their connection is gone, so every lease of it is void (``client.Lease``), and
records put from now on get generations above any the old supervisor handed
out, so no old ``(offset, gen)`` names a new record.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shmkv import __version__
from shmkv.core.arena import (
    FORMAT_VERSION,
    MAGIC,
    STATE_CLOSED,
    ArenaView,
    ArenaWriter,
    ChunkInfo,
    Geometry,
    Record,
    header_format,
    record_layout,
)
from shmkv.core.config import Settings, format_size
from shmkv.core.errors import (
    ArenaCorruptError,
    ArenaExistsError,
    ArenaIncompatibleError,
    ShmSpaceError,
    UnsafePathError,
    setup_error,
)
from shmkv.core.keys import chain_digests, content_digest
from shmkv.supervisor.arenafile import ArenaFile, _same_file, check_ours, map_arena
from shmkv.supervisor.chunks import Chunk
from shmkv.supervisor.pages import Extents, data_extents
from shmkv.supervisor.record import Entry
from shmkv.supervisor.store import Store

log = logging.getLogger(__name__)

#: the modes shmkv creates arena files with (0640: ``--group``); any other is not adopted
ADOPTABLE_MODES = (0o600, 0o640)

#: the highest generation adopted: half the u64 that records and slots keep it in, so
#: the store counts up from any adopted one and never leaves that range (2**63 puts, or
#: microseconds: 292,000 years). Above it, the file was written by something else.
MAX_ADOPTED_GEN = (1 << 63) - 1
#: the latest creation time adopted (the end of year 9999, which every tool can show)
MAX_ADOPTED_CREATED = 253_402_300_799.0


def open_leftover(af: ArenaFile) -> Geometry | None:
    """Take over the arena file a previous supervisor left; its new geometry, or None.

    None: there is no file, or nothing in it is worth keeping (a damaged header, or
    a size, chunk length or index size other than the settings ask for); the caller
    then creates a fresh arena, which removes this one. Raises UnsafePathError
    (not a plain file of ours, or a mode that let others write it) and
    ArenaIncompatibleError (another format): those are never adopted, and never
    removed without being asked (``--fresh``, ``shmkv clear``).
    """
    try:
        return _open_leftover(af)
    except OSError as e:
        raise setup_error(e, af.path, "--dir") from None


def _refusal(af: ArenaFile, problem: str) -> str:
    name = af.settings.name
    return (
        f"{af.path} {problem}: not adopted. Start with an empty arena with "
        f"`shmkv supervise --fresh` (SHMKV_FRESH=true), or remove it with "
        f"`shmkv clear --name {name}` while no supervisor runs"
    )


def _open_leftover(af: ArenaFile) -> Geometry | None:
    af.remove_leftovers(arena=False)  # half-made files of a supervisor killed at start
    try:
        check_ours(af.path, os.lstat(af.path), "arena file")
    except FileNotFoundError:
        return None
    fd = os.open(af.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        geometry = _check(af, fd)
        if geometry is None:
            return None
        return _take(af, fd, geometry)
    finally:
        os.close(fd)


def _check(af: ArenaFile, fd: int) -> Geometry | None:
    """The left arena's geometry if it may and should be adopted (see open_leftover)."""
    st = os.fstat(fd)
    check_ours(af.path, st, "arena file")
    mode = stat.S_IMODE(st.st_mode)
    if mode not in ADOPTABLE_MODES:
        raise UnsafePathError(
            _refusal(af, f"has mode {mode:04o}, not 0600 or 0640: others may have written it")
        )
    head = os.pread(fd, 4096, 0)
    if len(head) < 4096:
        log.warning("%s is %d bytes, too short to be an arena: starting empty", af.path, len(head))
        return None
    magic, version, _state = header_format(head)
    if magic != MAGIC:
        log.warning("%s is not a shmkv arena (bad magic): starting empty", af.path)
        return None
    if version != FORMAT_VERSION:
        raise ArenaIncompatibleError(
            _refusal(
                af,
                f"holds an arena of format {version}, and this shmkv ({__version__}) "
                f"reads format {FORMAT_VERSION}",
            )
        )
    try:
        old = Geometry.unpack(head, st.st_size)
    except ArenaCorruptError as e:
        log.warning("%s has a damaged header (%s): starting empty", af.path, e)
        return None
    if old.arena_size != st.st_size:
        log.warning(
            "%s is %d bytes, its header says %d: starting empty",
            af.path,
            st.st_size,
            old.arena_size,
        )
        return None
    s = af.settings
    try:
        want = Geometry.plan(s.size, s.chunk_tokens, s.index_slots)
    except ValueError:
        return None  # the fresh arena's creation reports it
    layout = ("arena_size", "index_slots", "data_offset", "data_size", "chunk_tokens")
    if any(getattr(old, f) != getattr(want, f) for f in layout):
        log.warning(
            "%s was made for --size %s, --chunk-tokens %d, %d index slots; the settings "
            "now ask for %s, %d, %d: starting empty",
            af.path,
            format_size(old.arena_size),
            old.chunk_tokens,
            old.index_slots,
            format_size(want.arena_size),
            want.chunk_tokens,
            want.index_slots,
        )
        return None
    return old


def _take(af: ArenaFile, fd: int, old: Geometry) -> Geometry:
    """Reserve, map and re-head the checked file; open the workers' read-only fd."""
    size, reserve = old.arena_size, af.settings.reserve
    try:
        # (its header and index exist, and with --reserve all of it: this only makes sure,
        # and a whole file needs no such walk of its pages)
        if os.fstat(fd).st_blocks * 512 < (size if reserve else old.data_offset):
            os.posix_fallocate(fd, 0, size if reserve else old.data_offset)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise ShmSpaceError(
                f"cannot reserve the {format_size(size)} of {af.path}: enlarge the tmpfs, or "
                f"start with --fresh and a smaller --size"
            ) from None
        raise
    if af.gid is not None and os.fstat(fd).st_gid != af.gid:
        os.fchown(fd, -1, af.gid)
    os.fchmod(fd, af.file_mode)
    _magic, _version, state = header_format(os.pread(fd, 4096, 0))
    # (the header and index mapped at once, the data region as it is written: mapping
    # every page of a --reserve arena first would delay the first answer by all of them)
    mm = map_arena(fd, size, False, old.data_offset)
    ro = rw = -1
    try:
        rw = os.dup(fd)
        ro = os.open(af.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        if not _same_file(af.path, fd) or not _same_file(af.path, ro):
            raise UnsafePathError(f"{af.path} was replaced while being adopted: check --dir")
        # a new identity: workers that attach now are this supervisor's
        geometry = dataclasses.replace(
            old, supervisor_pid=os.getpid(), created=time.time(), arena_id=os.urandom(16)
        )
        ArenaWriter(mm, geometry).format()
    except BaseException:
        for d in (ro, rw):
            if d >= 0:
                os.close(d)
        mm.close()
        raise
    af.mm, af.geometry, af.ro_fd, af.rw_fd = mm, geometry, ro, rw
    log.info(
        "adopting arena %s left by supervisor pid %d (%s)",
        af.path,
        old.supervisor_pid,
        "stopped" if state == STATE_CLOSED else "killed or crashed",
    )
    return geometry


@dataclass
class Adopted:
    """What an :class:`Adoption` found: records adopted and dropped, slots caught mid-write."""

    entries: int = 0
    bytes: int = 0
    dropped: int = 0
    torn_slots: int = 0
    seconds: float = 0.0
    #: payload and chunk bytes hashed to check them (each chunk once)
    checked_bytes: int = 0


def _valid(
    view: ArenaView,
    data: Extents,
    offset: int,
    gen: int,
    intact: dict[tuple[int, int], bool],
    out: Adopted,
) -> tuple[Record, list[Chunk]] | None:
    """The record (offset, gen) and the chunks it names if every check a worker makes
    passes, payload included: a whole record's XXH3-64; a chunked one's manifest and each
    chunk's XXH3-128 (its header's), each chunk hashed once whatever number of records
    name it (``intact``: (offset, generation) -> the answer), so that adoption costs the
    arena's bytes, not the sum of its states'. A chunked record's inline rows are checked
    by the worker that restores it (``ArenaView.assembled`` checks the whole state's
    XXH3-64 every time): damage there costs that restore a miss.

    Its pages must all exist before the mapping reads them: a slot of a damaged arena
    may name a hole (``pages.py``), and a fault on one allocates it, or SIGBUSes when the
    tmpfs is full. So the header (and a chunked record's body and chunk headers) is read
    with ``pread``, and each extent it claims is looked up for holes first (in ``data``,
    the file's runs of data, walked once: ``pages.data_extents``).
    A chunk of another publisher than its record's is damage: records never share across
    publishers.
    """
    try:
        head, _ = view.peek(offset, gen)
        extents = [(offset, record_layout(head.n_tokens, head.fp_len, head.body_len)[3])]
        chunks: list[Chunk] = []
        named: list[ChunkInfo] = []
        if head.chunked:
            manifest, _refs, infos = view.peek_chunks(head)
            if manifest.blob_len != head.payload_len:
                return None
            for info, sig in zip(infos, manifest.group_sigs, strict=True):
                if info is None:
                    continue
                if info.publisher != head.publisher or not 0 < info.gen <= MAX_ADOPTED_GEN:
                    return None
                key = (info.publisher, bytes(sig), info.digest)
                chunks.append(Chunk(key, info.offset, info.gen, info.length, info.extent))
                extents.append((info.offset, info.extent))
                named.append(info)
        if any(data.minus(off, off + n) for off, n in extents):
            return None
        rec = view.read_record(offset, gen)
        view.verify_meta(rec)
    except (ArenaCorruptError, OSError):
        return None
    if not _in_range(rec):
        return None
    if not rec.chunked:
        out.checked_bytes += rec.payload_len
        return (rec, chunks) if view.verify_payload(rec) else None
    for info in named:
        ok = intact.get((info.offset, info.gen))
        if ok is None:
            ok = intact[(info.offset, info.gen)] = view.chunk_intact(info)
            out.checked_bytes += info.length
        if not ok:
            return None
    return rec, chunks


def _in_range(rec: Record) -> bool:
    """Are the record's numbers ones this supervisor can use again? Its checksums say the
    bytes are as written, not that a supervisor wrote them: a generation near 2**64 would
    make every later put's generation overflow its u64 (what else a record carries is
    bounded by its layout: ``ArenaView._parse_record``, or read from a u32 and kept as is).
    """
    ok = 0 < rec.gen <= MAX_ADOPTED_GEN and 0.0 <= rec.created <= MAX_ADOPTED_CREATED
    if not ok:
        log.warning(
            "record at %d has generation %d, created %r: out of range, not adopted",
            rec.offset,
            rec.gen,
            rec.created,
        )
    return ok


class Adoption:
    """Filling the empty ``store`` with the intact records of the adopted arena, a slice at
    a time (:meth:`step`), so that the supervisor answers long before a large arena is
    checked (``--adopt-wait``: how long it checks before it answers).

    ``view`` reads the arena as a worker does. Records are checked newest first (the
    generation their index slots carry), and one a lease is asked for is checked at once
    (:meth:`now`). Until every record is checked the index stays as the old supervisor
    left it: a slot names a record adopted, one still to check (a lease on it checks it
    first) or one dropped (a lease on it is refused: a miss); puts wait, and nothing is
    evicted, expired or given back to the tmpfs (``Store.adopting``), so the bytes a
    record still to check claims stay as they were. Then the index is rebuilt in place
    from the records kept, a slice at a time (:meth:`_repoint`): slots that named damaged
    records are gone, each chunk digest points at the owner :meth:`IndexOwners.point`
    chooses. LRU order is the records' age (oldest evicted first: the layout keeps no last
    use), every entry counts as used at adoption (what ``--ttl`` measures from), and no
    entry is pinned. A supervisor killed during an adoption leaves the index as it found
    it, or rebuilt in part: the next one adopts the same records.

    Two records that claim the same bytes (only damage makes them), or two of one content,
    keep the first checked (the newer, unless a lease asked for the older first).
    """

    def __init__(self, store: Store, view: ArenaView) -> None:
        self.store, self.view, self.t0 = store, view, time.monotonic()
        self.out = Adopted()
        g = store.geometry
        slots, self.out.torn_slots = store.arena.used_slots()
        store.arena.drop_torn()  # (before any lookup: a torn slot would end its probe run)
        # the slots by record, newest first (a record's slots are one run of them)
        slots = slots[np.lexsort((slots["rec_offset"], -slots["rec_gen"].astype(np.int64)))]
        self._slots = slots
        off, gen = slots["rec_offset"], slots["rec_gen"]
        new_run = np.r_[len(slots) > 0, (off[1:] != off[:-1]) | (gen[1:] != gen[:-1])]
        starts = np.flatnonzero(new_run)
        ends = np.r_[starts[1:], len(slots)][: len(starts)]
        offs, gens = off[starts].tolist(), gen[starts].tolist()
        #: (offset, gen) -> its run of slots, newest first: the records still to check
        self.pending: dict[tuple[int, int], tuple[int, int]] = dict(
            zip(
                zip(offs, gens, strict=True),
                zip(starts.tolist(), ends.tolist(), strict=True),
                strict=True,
            )
        )
        self._chunk_of: dict[bytes, int] = {}
        self._order = iter(list(self.pending))
        self.intact: dict[tuple[int, int], bool] = {}
        #: the chunks adopted, by offset (one a later record names is shared, not re-read)
        self.chunk_at: dict[int, Chunk] = {}
        self.data = data_extents(view.fd, g.data_offset, g.arena_size)
        # the arena keeps no last use: a record's age says nothing of when it was last used
        # (a system prompt hit every second may be days old), so each counts as used now:
        # --ttl runs from the adoption, never from the put (or every record older than
        # --ttl would go at the first tick after a restart)
        self.now_used = store.clock()
        self._pointing: list[tuple[bytes, bool]] | None = None
        store.adopting = True

    @property
    def remaining(self) -> int:
        """Records still to check."""
        return len(self.pending)

    def now(self, offset: int, gen: int) -> None:
        """A lease is asked for record (offset, gen): check it now if it is still to."""
        run = self.pending.pop((offset, gen), None)
        if run is not None:
            self.store.counters.adopt_on_lease += 1
            self._check(offset, gen, run)

    def cancel(self) -> None:
        """Check nothing more (``shmkv clear``): the records not yet checked are dropped."""
        self.out.dropped += len(self.pending)
        self.pending.clear()

    def step(self, deadline: float) -> bool:
        """Check records (then point the index) until ``deadline``; True once done."""
        while self.pending:
            key = next(self._order)
            run = self.pending.pop(key, None)
            if run is not None:
                self._check(*key, run)
            if time.monotonic() >= deadline:
                return False
        store = self.store
        if self._pointing is None:
            self._pointing = self._repoint()
        while self._pointing:
            for d, owned in self._pointing[-256:]:
                if owned and d in store.owners:
                    k = self._chunk_of[d]
                    if store.arena.index_get(d) == store.index.wanted(d, k):
                        continue  # (as the old supervisor left it: not written again)
                    if not store.index.point(d, k):
                        log.warning(
                            "index probe limit reached; adopted prefix %s not indexed",
                            d.hex()[:12],
                        )
                elif not owned and d not in store.owners:
                    store.arena.index_del(d)
            del self._pointing[-256:]
            if time.monotonic() >= deadline:
                return False
        self._finish()
        return True

    def _repoint(self) -> list[tuple[bytes, bool]]:
        """What rebuilding the index takes, done last first: (digest, owned) pairs, every
        digest an adopted record owns (pointed at the owner ``IndexOwners.point`` chooses,
        where its slot names another) after every old slot's digest that none owns
        (removed). The index is rebuilt in place, so that a supervisor killed meanwhile
        leaves every adopted record named as before (a slot it was writing is torn, which
        the next adoption removes first: :meth:`ArenaWriter.drop_torn`)."""
        store = self.store
        self._chunk_of = {d: k for e in store.entries.values() for k, d in enumerate(e.digests, 1)}
        old = dict.fromkeys(map(bytes, self._slots["digest"]))
        stale = [d for d in old if d not in store.owners]
        self._slots = self._slots[:0]
        # (popped from the end: the stale slots go first, so the pointing finds room)
        return [(d, True) for d in store.owners] + [(d, False) for d in stale]

    def _check(self, offset: int, gen: int, run: tuple[int, int]) -> None:
        """Adopt record (offset, gen), which the slots ``run`` name, if it passes every
        check and claims no bytes another adopted one holds."""
        store, view, out = self.store, self.view, self.out
        named = self._slots[run[0] : run[1]]
        by_slot = dict(zip(map(bytes, named["digest"]), named["n_chunks"].tolist(), strict=True))
        valid = _valid(view, self.data, offset, gen, self.intact, out)
        if valid is None:
            out.dropped += 1
            return
        rec, found = valid
        toks = view.tokens(rec)
        digests = chain_digests(rec.root, toks, store.geometry.chunk_tokens)
        chain = {d: k for k, d in enumerate(digests, 1)}
        if (
            not digests
            or digests[-1] != rec.key
            or all(chain.get(d) != k for d, k in by_slot.items())
        ):
            out.dropped += 1  # (only damaged slots name it)
            return
        fp = bytes(view.fingerprint(rec))
        content = content_digest(rec.root, fp, toks.tobytes(), rec.publisher)
        if content in store.by_content:
            out.dropped += 1  # (one record per content, as the store keeps it)
            return
        *_, extent = record_layout(rec.n_tokens, rec.fp_len, rec.body_len)
        held = self._take(rec.offset, extent, found)
        if held is None:
            out.dropped += 1
            return
        e = Entry(
            rec.gen,
            rec.offset,
            extent,
            rec.key,
            rec.root,
            rec.n_tokens,
            rec.payload_len,
            digests,
            content,
            rec.created,
            last_used=self.now_used,
            publisher=rec.publisher,
            chunks=held,
        )
        store.insert(e, point=False)
        store.make_oldest(e)  # (checked newest first: each older one goes before it)
        out.entries += 1
        out.bytes += rec.payload_len

    def _take(self, offset: int, extent: int, found: list[Chunk]) -> list[Chunk] | None:
        """Reserve the record's extent and those of its chunks not adopted before (each
        chunk once, a reference per record that names it); None, with nothing taken, if
        any of them overlaps bytes an adopted record or chunk holds (or a chunk adopted
        before was freed since)."""
        store = self.store
        taken = [(offset, extent)]
        new: dict[int, Chunk] = {}  # (by offset: a record may name one chunk twice)
        held: list[Chunk] = []
        ok = True
        try:
            store.alloc.reserve(offset, extent)
            for c in found:
                if (mine := new.get(c.offset)) is not None:
                    held.append(mine)
                    continue
                have = self.chunk_at.get(c.offset)
                if have is None:
                    taken.append((c.offset, c.extent))
                    store.alloc.reserve(c.offset, c.extent)
                    new[c.offset] = c
                    held.append(c)
                elif (have.gen, have.extent) == (c.gen, c.extent) and have.refs > 0:
                    held.append(have)
                else:
                    ok = False
                    break
        except ValueError:
            taken.pop()  # (the last one is the reserve that failed: it took nothing)
            ok = False
        if not ok:
            for off, n in taken:
                store.alloc.release(off, n)
            return None
        self.chunk_at.update(new)
        for c in new.values():
            store.chunks.add(c)
        for c in held:
            store.chunks.ref(c)
        return held

    def _finish(self) -> None:
        store, out = self.store, self.out
        # above every generation the old supervisor handed out (even of records it had
        # dropped since), so that no old (offset, gen) names a new record: a put takes
        # more than a microsecond
        top = max((e.gen for e in store.entries.values()), default=0)
        top = max([top, *(c.gen for c in self.chunk_at.values())])
        store.gens_from(max(top + 1, int(time.time() * 1e6)))
        store.counters.adopted += out.entries
        store.counters.adopt_dropped += out.dropped
        store.counters.adopt_checked_bytes += out.checked_bytes
        store.adopting = False
        for off, n in store.alloc.extents():  # (what the old arena held there)
            store.pages.freed(off, n)
        out.seconds = time.monotonic() - self.t0
        log.info(
            "adopted %d entries (%s, %s hashed) in %.3f s; dropped %d damaged or half-written "
            "record(s)%s",
            out.entries,
            format_size(out.bytes),
            format_size(out.checked_bytes),
            out.seconds,
            out.dropped,
            f", {out.torn_slots} index slot(s) caught mid-write" if out.torn_slots else "",
        )


def remove_left(settings: Settings, why: str) -> Path | None:
    """``shmkv clear`` with no supervisor answering: remove the arena file a stopped or
    killed supervisor left, so that the next start is empty; the path removed, or None.

    Takes the name's lock first, as a supervisor would: while a supervisor holds it
    (alive but not answering: ``why``) nothing is removed.
    """
    af = ArenaFile(settings, None)
    try:
        af.lock()
    except ArenaExistsError:
        try:
            pid = af.lock_path.read_text().strip() or "?"
        except OSError:
            pid = "?"
        raise ArenaExistsError(
            f"a supervisor (pid {pid}) holds arena {settings.name!r} but does not answer "
            f"({why}): stop it first (its own shutdown removes the arena unless --keep), "
            f"then run `shmkv clear` again"
        ) from None
    try:
        existed = os.path.lexists(af.path)
        af.remove_leftovers(arena=True)
    except OSError as e:
        raise setup_error(e, af.path, "--dir") from None
    finally:
        af.close(remove=True)
    return af.path if existed else None
