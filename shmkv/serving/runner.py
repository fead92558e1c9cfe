"""``shmkv serve``: the supervisor and gunicorn together, for the main job in one command.

This process only starts and watches the two: the supervisor (unless one is
already running on the same socket, which is then shared) and gunicorn with
``workers/gunicorn_conf.py``. A supervisor that dies is restarted (workers run
cold meanwhile and reattach by themselves); SIGTERM or SIGINT stops gunicorn
first, then the supervisor; SIGHUP (systemd's reload) is passed on to both:
gunicorn replaces its workers gracefully, the supervisor logs its stats.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shmkv.core.client import Client
from shmkv.core.config import SETTINGS, Settings
from shmkv.core.errors import ConfigError, ShmkvError, SupervisorUnavailable, UntrustedSupervisor
from shmkv.core.kvtypes import llama_kwargs
from shmkv.serving.default_model import default_model_path

log = logging.getLogger(__name__)


def gunicorn_conf_path() -> Path:
    """The gunicorn config of ``workers/`` (installed as ``shmkv_workers``), found without
    importing it: the HTTP side sits above ``shmkv serve`` and is only run by gunicorn."""
    spec = importlib.util.find_spec("shmkv_workers")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "shmkv_workers is not installed: reinstall shmkv with `pip install 'shmkv[serve]'`"
        )
    return Path(spec.origin).parent / "gunicorn_conf.py"


def settings_env(settings: Settings) -> dict[str, str]:
    """The resolved settings as SHMKV_* variables, for the child processes."""
    env = dict(os.environ)
    env.pop("SHMKV_CONFIG", None)  # already applied
    for name, value in settings.values.items():
        var = SETTINGS[name].env
        if value is None:
            env.pop(var, None)
        elif isinstance(value, list):
            env[var] = ",".join(str(x) for x in value)
        elif isinstance(value, bool):
            env[var] = "true" if value else "false"
        else:
            env[var] = str(value)
    env["SHMKV_SOCKET"] = settings.socket_path
    return env


def supervisor_running(settings: Settings) -> bool:
    """Whether our supervisor answers on the socket; UntrustedSupervisor if another
    user's process does (starting one of our own there would not help)."""
    # a probe, not a worker: no "cache unavailable" warning for a supervisor that is not
    # there yet (serve starts one, or says why it could not)
    client_log = logging.getLogger("shmkv.core.client")
    level = client_log.level
    client_log.setLevel(logging.ERROR)
    try:
        with Client(settings=settings, populate=False, attach=False) as c:
            c.request({"op": "ping"})
        return True
    except UntrustedSupervisor:
        raise
    except ShmkvError:
        return False
    finally:
        client_log.setLevel(level)


def _child_setup() -> None:
    """In each child: own process group (a terminal's Ctrl-C reaches only us, and we stop
    the children in order), and SIGTERM if we die without stopping them."""
    import ctypes

    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Serve:
    """Runs and watches the supervisor and gunicorn."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sup: subprocess.Popen[bytes] | None = None
        self.gunicorn: subprocess.Popen[bytes] | None = None
        self.owns_supervisor = False
        self._stop: int | None = None
        self._reload = False

    def _start_supervisor(self, env: dict[str, str]) -> None:
        self.sup = subprocess.Popen(
            [sys.executable, "-m", "shmkv", "supervise"], env=env, preexec_fn=_child_setup
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.sup.poll() is not None:
                raise SupervisorUnavailable(
                    f"the supervisor exited with code {self.sup.returncode} (see the line above)"
                )
            if supervisor_running(self.settings):
                return
            time.sleep(0.05)
        raise SupervisorUnavailable("the supervisor did not come up within 30 s")

    def run(self) -> int:
        if not self.settings.model:
            self.settings.values["model"] = [default_model_path()]
        aliases = self.settings.model_alias or []
        if len(aliases) > len(self.settings.model):
            raise ConfigError(
                f"{len(aliases)} --model-alias for {len(self.settings.model)} --model: "
                "give at most one alias per model, in the same order"
            )
        # a KV cache setting llama.cpp would refuse: one line now, not a failing worker later
        s = self.settings
        llama_kwargs(s.cache_type_k, s.cache_type_v, s.flash_attn)
        env = settings_env(self.settings)
        if supervisor_running(self.settings):
            log.info("using the running supervisor on %s", self.settings.socket_path)
        else:
            self._start_supervisor(env)
            self.owns_supervisor = True
        conf = gunicorn_conf_path()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _f: setattr(self, "_stop", signum))
        signal.signal(signal.SIGHUP, lambda _s, _f: setattr(self, "_reload", True))
        self.gunicorn = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(conf)], env=env, preexec_fn=_child_setup
        )
        settings = self.settings
        log.info(
            "serving %s on http://%s:%d with %d workers",
            ", ".join(Path(m).name for m in settings.model),
            settings.host,
            settings.port,
            settings.workers,
        )
        backoff = 0.5
        try:
            while self._stop is None:
                if self._reload:
                    self._reload = False
                    self.reload()
                if self.gunicorn.poll() is not None:
                    log.error("gunicorn exited with code %s", self.gunicorn.returncode)
                    return self.gunicorn.returncode or 1
                if self.owns_supervisor and self.sup is not None and self.sup.poll() is not None:
                    log.error(
                        "supervisor exited with code %s; restarting it in %.1fs",
                        self.sup.returncode,
                        backoff,
                    )
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10)
                    try:  # (a restart adopts what the dead one left, even after --fresh)
                        self._start_supervisor({**env, "SHMKV_FRESH": "false"})
                        backoff = 0.5
                    except ShmkvError as e:
                        log.error("%s", e)
                time.sleep(0.2)
            log.info("received %s: stopping", signal.Signals(self._stop).name)
            return 0
        finally:
            self.shutdown()

    def reload(self) -> None:
        """SIGHUP to gunicorn (new workers, the old ones stopped gracefully) and to our
        supervisor (it logs its stats): what systemd's reload does to each unit."""
        log.info("received SIGHUP: reloading the workers")
        for proc in (self.gunicorn, self.sup if self.owns_supervisor else None):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGHUP)

    def shutdown(self) -> None:
        for proc in (self.gunicorn, self.sup if self.owns_supervisor else None):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not stop in 40 s: killing it", proc.pid)
                proc.kill()
                proc.wait()


def serve(settings: Settings) -> int:
    if settings.workers < 1:
        raise ConfigError("--workers must be at least 1")
    return Serve(settings).run()
