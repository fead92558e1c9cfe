"""What the test modules share, one theme per module; each helper is defined once.

Runs in the pytest process (``llama_worker.py`` is a script the tests start). Test modules
import from here and take the fixtures of ``tests/conftest.py``, never from one another:

* ``waiting``: :func:`~tests.support.waiting.wait_until`, descriptors, signal deaths;
* ``cli``: the ``shmkv`` command line as a subprocess, and its one-line errors;
* ``users``: real other users (root only) and running code as one of them;
* ``supervisors``: ``shmkv supervise`` processes (:class:`~tests.support.supervisors.Sup`);
* ``blobs``: blobs that are a pure function of a seed or of their key;
* ``kvblobs``: sequence-state blobs in llama.cpp's format, made without a model;
* ``arenas``: an arena file and a Store over it, in the test's process;
* ``peer``: a raw protocol peer that writes frames by hand;
* ``llama_workers``: llama worker processes (``llama_worker.py``) and their jobs;
* ``media``: images without a projector: embedding batches (in llama workers);
* ``servers``: gunicorn as ``shmkv serve`` runs it, and Prometheus scrapes;
* ``tmpfs``: small tmpfs mounts;
* ``cpu``: the CPU budget's board (who waits in line for cores);
* ``tinymodel``: the tiny GGUF models the session writes.
"""

from __future__ import annotations

from pathlib import Path

#: this folder, the tests folder and the checkout
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
SHM = Path("/dev/shm")
MiB = 1 << 20
