"""What ``/proc`` says of another process: read by every process that judges a peer."""

from __future__ import annotations


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)``: state first, then ppid, ...
    (``proc(5)``'s third field on), or None if it cannot be read. comm may hold spaces
    and parentheses, so the fields start after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 1 :].split()
    except (OSError, ValueError):
        return None
