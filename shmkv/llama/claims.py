"""The prefills a worker claimed (``Client.claim``) and has to end.

Runs inside a worker. A call that claims a prompt's chunks (other workers then wait
for its publish instead of computing the same prefill) ends its claim when the
publish is queued (the supervisor ends it with the put), or here when it will not
publish: at once on the call's own thread, or, for a call whose stream was closed
late on another thread, by the next call of the cache (on the reader's thread).
"""

from __future__ import annotations

import logging

from shmkv.core.client import Client
from shmkv.core.errors import ShmkvError

log = logging.getLogger(__name__)


class Claims:
    """Ends one cache's claims through its reader connection."""

    def __init__(self, reader: Client) -> None:
        self.reader = reader
        #: claims of calls closed late, for the next call to end
        self._orphaned: list[list[bytes]] = []

    def end(self, digests: list[bytes]) -> None:
        """Let the workers waiting for ``digests`` go (best effort)."""
        try:
            self.reader.unclaim(digests)
        except ShmkvError as e:
            log.debug("unclaim failed: %s", e)

    def orphan(self, digests: list[bytes]) -> None:
        """Claims of a call closed late, on any thread: the next call ends them."""
        self._orphaned.append(digests)  # (list.append is atomic)

    def end_orphaned(self) -> None:
        """End the claims of calls closed late (on the thread that holds the reader)."""
        while self._orphaned:
            self.end(self._orphaned.pop())
