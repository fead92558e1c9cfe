"""gunicorn configuration for shmkv workers (``gunicorn -c this_file``).

Pre-fork safety: the app is not preloaded, so each worker loads its model and
attaches to the supervisor after fork (llama.cpp threads and contexts never
cross a fork). A worker flushes and detaches on exit; the master tells the
supervisor when a worker died, so whatever it held is released at once even
if the kernel has not yet closed its socket. The workers share one CPU budget
(``shmkv/llama/cpu/budget.py``); the master removes its file when it exits.

Every value comes from ``shmkv.core.config`` (``SHMKV_*`` environment variables).
"""

from __future__ import annotations

import logging

from shmkv.core.config import resolve

_s = resolve("serve")

bind = f"{_s.host}:{_s.port}"
workers = _s.workers
# uvicorn's worker, except that a busy worker stops accepting (see workers/worker.py)
worker_class = "shmkv_workers.worker.ShmkvWorker"
wsgi_app = "shmkv_workers.app:create_app()"
preload_app = False
timeout = int(_s.worker_timeout)
graceful_timeout = 30
keepalive = 5
loglevel = _s.log_level
proc_name = f"shmkv-{_s.name}"
# bound request sizes: prompts travel in the body; these cap the request line/headers
limit_request_line = 8190
limit_request_fields = 100

log = logging.getLogger("shmkv.gunicorn")


def on_starting(server) -> None:  # in the master, once, before it forks the workers
    # the load warnings (AMX, a CPU-only build asked for GPU layers) once per deployment:
    # the workers, forked from here, inherit having given them
    from shmkv.serving.model_settings import warn_once

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=getattr(logging, _s.log_level.upper()),
            format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        )
    warn_once(_s)


def worker_exit(server, worker) -> None:  # in the worker
    from shmkv.llama import close_all

    close_all()


def on_exit(server) -> None:  # in the master, after its workers stopped
    from shmkv.llama.cpu import budget as cpubudget

    cpubudget.remove(_s.dir, _s.name)  # (unless another deployment on this name uses it)


def child_exit(server, worker) -> None:  # in the master
    from shmkv.core.client import Client
    from shmkv.core.errors import ShmkvError

    try:
        with Client(settings=_s, populate=False, attach=False) as c:
            released = c.worker_exit(worker.pid)
        if released:
            server.log.info("worker %s exited: released %d shmkv lease(s)", worker.pid, released)
    except ShmkvError as e:
        server.log.info("worker %s exited; shmkv supervisor not told: %s", worker.pid, e)
