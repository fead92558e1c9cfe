"""systemd integration of ``shmkv supervise``: readiness and watchdog notifications.

Runs in the supervisor. Type=notify services get READY=1 / STOPPING=1 and, when
the unit sets WatchdogSec=, WATCHDOG=1 at half the period systemd asks for.
Outside systemd ($NOTIFY_SOCKET unset) every call is a no-op. A few lines of
stdlib, as gunicorn's ``systemd.py``: no libsystemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


def sd_notify(message: str) -> bool:
    """Send one datagram to $NOTIFY_SOCKET (systemd Type=notify); False if not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd at %s: %s", addr, e)
        return False


def watchdog_interval() -> float | None:
    """Half the watchdog period systemd asks for, or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


class Watchdog:
    """Sends WATCHDOG=1 whenever the loop passes by and one is due."""

    def __init__(self) -> None:
        self.interval = watchdog_interval()
        self._next = time.monotonic()

    def tick(self, now: float) -> float | None:
        """Notify if due; seconds until the next one is due, or None without a watchdog."""
        if self.interval is None:
            return None
        if now >= self._next:
            sd_notify("WATCHDOG=1")
            self._next = now + self.interval
        return max(0.0, self._next - now)
