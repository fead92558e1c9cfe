"""The one error tree of shmkv, shared by every process.

Every failure a user can meet is a leaf of :class:`ShmkvError` whose message
names the setting or command that fixes it. Errors cross the supervisor's
socket as ``{"code": ..., "message": ...}`` and are rebuilt on the other side
by :func:`from_wire`, so a worker sees the same class the supervisor raised.
Each class carries the exit code a command ends with when it fails with it;
the codes are named once, here.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_ARENA_EXISTS = 3
EXIT_NO_SPACE = 4
EXIT_UNAVAILABLE = 5
EXIT_PERMISSION = 6
#: the supervisor's arena file was truncated under it: restart it with a fresh arena
EXIT_ARENA_LOST = 7
#: a file, directory or supervisor is not owned by whom it must be (another user's trap?)
EXIT_UNTRUSTED = 8
#: the arena file a previous supervisor left is of another format: start with --fresh
EXIT_ARENA_INCOMPATIBLE = 9

__all__ = [
    "ShmkvError",
    "ConfigError",
    "ArenaError",
    "ArenaExistsError",
    "ArenaFullError",
    "ArenaCorruptError",
    "ArenaIncompatibleError",
    "ShmSpaceError",
    "SupervisorUnavailable",
    "SupervisorBusy",
    "PermissionDenied",
    "UnsafePathError",
    "UntrustedSupervisor",
    "ProtocolError",
    "BadRequest",
    "ChecksumMismatch",
    "NotFound",
    "LeaseLost",
    "UntrustedPublisher",
    "ModelMismatchError",
    "StateRefused",
    "ClosedError",
    "LimitExceeded",
    "InvalidTenant",
    "TierError",
    "from_wire",
]


class ShmkvError(Exception):
    """Root of every shmkv error; ``code`` is its stable wire name."""

    code = "error"
    exit_code = EXIT_FAILURE

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self)}


class ConfigError(ShmkvError):
    """A setting has a value that cannot work."""

    code = "config"
    exit_code = EXIT_CONFIG


class ArenaError(ShmkvError):
    """Something is wrong with the arena file."""

    code = "arena"


class ArenaExistsError(ArenaError):
    """Another live supervisor already owns this arena name."""

    code = "arena_exists"
    exit_code = EXIT_ARENA_EXISTS


class ArenaFullError(ArenaError):
    """A blob can never fit, or nothing can be evicted to make room."""

    code = "arena_full"


class ArenaCorruptError(ArenaError):
    """The arena header or a record failed validation."""

    code = "arena_corrupt"


class ArenaIncompatibleError(ArenaError):
    """The arena file a previous supervisor left is of another format: never adopted."""

    code = "arena_incompatible"
    exit_code = EXIT_ARENA_INCOMPATIBLE


class ShmSpaceError(ArenaError):
    """The shared-memory filesystem has less free space than ``--size``."""

    code = "shm_space"
    exit_code = EXIT_NO_SPACE


class SupervisorUnavailable(ShmkvError):
    """No supervisor answers on the socket."""

    code = "unavailable"
    exit_code = EXIT_UNAVAILABLE


class SupervisorBusy(SupervisorUnavailable):
    """The supervisor refused the connection (connection limit reached)."""

    code = "busy"


class PermissionDenied(ShmkvError):
    """The peer may not use this supervisor, or a file mode forbids access."""

    code = "permission"
    exit_code = EXIT_PERMISSION


class UnsafePathError(PermissionDenied):
    """A socket directory, lock or arena file that another user owns or could replace."""

    code = "unsafe_path"
    exit_code = EXIT_UNTRUSTED


class UntrustedSupervisor(SupervisorUnavailable):
    """The process on the socket runs as a uid the client does not trust (SO_PEERCRED)."""

    code = "untrusted_supervisor"
    exit_code = EXIT_UNTRUSTED


class ProtocolError(ShmkvError):
    """A frame could not be decoded (bad length, bad msgpack, oversize)."""

    code = "protocol"


class BadRequest(ProtocolError):
    """A decoded message has a missing, mistyped or out-of-bounds field."""

    code = "bad_request"


class ChecksumMismatch(BadRequest):
    """A blob's bytes do not match the checksum sent with it."""

    code = "checksum"


class NotFound(ShmkvError):
    """The entry asked for is not (or no longer) in the arena."""

    code = "not_found"


class LeaseLost(ShmkvError):
    """A read lease was revoked while the blob was in use: the read is void."""

    code = "lease_lost"


class UntrustedPublisher(ShmkvError):
    """A cached state was published by a uid this worker does not trust (``--trust-publishers``)."""

    code = "untrusted"


class ModelMismatchError(ShmkvError):
    """A cached blob belongs to another model or context configuration."""

    code = "model_mismatch"


class StateRefused(ShmkvError):
    """llama.cpp refused a cached state that passed every check (``set_data`` failed, e.g.
    the state needs more cells than this context has): a miss, not a corrupt record."""

    code = "state_refused"


class ClosedError(ShmkvError):
    """A handle was used after ``close()``."""

    code = "closed"


class LimitExceeded(ShmkvError):
    """A peer asked for more than one connection may hold (pins, leases, ...)."""

    code = "limit"


class StateFileError(ShmkvError):
    """A state file (``shmkv export``) is malformed, corrupt, or not what it claims to be:
    nothing of it is imported."""

    code = "state_file"


class BadInput(ShmkvError):
    """A line of ``shmkv warm``'s input is not a prompt or a chat it can render."""

    code = "bad_input"


class InvalidTenant(ShmkvError):
    """A request named its cache tenant with a value shmkv does not accept (a
    ``cache_salt`` too long, empty, not a string or with control characters)."""

    code = "invalid_tenant"


class TierError(ShmkvError):
    """A write-behind tier (``--persist``) failed; ``kind`` names the failure for counting.

    Never reaches a worker: the tier pauses, counts it and logs this message.
    """

    code = "tier"

    def __init__(self, message: str, kind: str = "io") -> None:
        super().__init__(message)
        self.kind = kind


_BY_CODE: dict[str, type[ShmkvError]] = {}


def _register(cls: type[ShmkvError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(ShmkvError)


def setup_error(e: OSError, path: Path, setting: str) -> ShmkvError:
    """An OSError met while creating a file or socket, as one line naming the fix."""
    msg = (
        f"cannot create {e.filename or path}: {e.strerror or e}: fix {setting} or the "
        f"permissions there"
    )
    return PermissionDenied(msg) if e.errno in (errno.EACCES, errno.EPERM) else ConfigError(msg)


def from_wire(obj: Any) -> ShmkvError:
    """Rebuild an error sent by the peer; unknown or malformed ones become ShmkvError."""
    if isinstance(obj, dict):
        code, message = obj.get("code"), obj.get("message")
        if isinstance(code, str) and isinstance(message, str):
            return _BY_CODE.get(code, ShmkvError)(message[:4096])
    return ProtocolError(f"malformed error reply from the peer: {obj!r:.200}")
