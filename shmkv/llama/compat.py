"""Every private name of llama-cpp-python that shmkv uses, in one place.

Runs in a process that holds a ``Llama``. llama-cpp-python has no public way to say
"the context's cells changed under you", to find the chat handler a format name
stands for, to list a context's parameters or to hook the completion that every
``create_completion`` goes through; shmkv reads or replaces these internals, as they
are in every release from :data:`KNOWN_VERSIONS` ``[0]`` to ``[1]`` (read from
``llama_cpp/llama.py`` and ``llama_cpp.py``: :data:`REQUIREMENT`, which pyproject.toml
requires). Nothing else in shmkv touches an underscore name of llama-cpp-python; the
HTTP side's (``llama_cpp.server``) are in ``workers/compat.py``.

The range is bounded above by the next minor release, which may rename these private
names. It starts at 0.3.32, the first ``Llama.generate`` that reads ``_requires_eval``
and samples a prompt the context holds whole without evaluating its last token again.
0.3.17 to 0.3.31 have every C API binding shmkv calls (``llama_n_ctx_seq`` appeared in
0.3.17) but replay that token: built and tested, 0.3.17 failed to decode a prompt that
ends with a chat handler's image (the replayed position is a media mark), its llama.cpp
serializes a sliding-window cache whole (up to 0.3.24) and takes a q8_0 cache that
0.3.32's refuses. ``.ci/llama-versions`` builds both ends and runs the llama tests on
each (docs/development.md says when to run it).

:func:`check` runs when a cache attaches (``SharedPrefixCache``): on a version outside
the range it verifies that each internal and binding is still there and raises one
:class:`~shmkv.core.errors.ConfigError` naming those missing and the versions known
(it logs a warning once if all are there).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as lc

from shmkv.core.errors import ConfigError

log = logging.getLogger(__name__)

#: the oldest and the newest llama-cpp-python whose internals this module was read from
#: (every release between them was read too; .ci/llama-versions tests both ends)
KNOWN_VERSIONS = ("0.3.32", "0.3.36")
#: the first release not read: a minor release may rename the private names used here
BELOW = "0.4"
#: what installs a known version (pyproject.toml's requirement, tests/llama/test_versions.py)
REQUIREMENT = f"llama-cpp-python>={KNOWN_VERSIONS[0]},<{BELOW}"

#: ``Llama`` methods shmkv hooks (``hooks.py``) or overrides (``SharedCacheLlama``)
COMPLETION = "_create_completion"
#: instance attributes read or written here
_ATTRIBUTES = ("_requires_eval", "_chat_handlers", "_logits_all", "_ctx")
#: the C API bindings (``llama_cpp.llama_cpp``) shmkv calls unconditionally (all there
#: since 0.3.17; 0.3.16 lacks ``llama_n_ctx_seq``)
FUNCTIONS = (
    "llama_get_memory",
    "llama_memory_clear",
    "llama_memory_seq_pos_max",
    "llama_memory_seq_pos_min",
    "llama_memory_seq_rm",
    "llama_model_get_vocab",
    "llama_model_n_layer",
    "llama_model_n_swa",
    "llama_n_ctx",
    "llama_n_ctx_seq",
    "llama_n_seq_max",
    "llama_print_system_info",
    "llama_set_n_threads",
    "llama_state_seq_get_data",
    "llama_state_seq_get_size",
    "llama_state_seq_set_data",
    "llama_supports_gpu_offload",
    "llama_vocab_is_eog",
)

_warned = False


def _release(version: str) -> tuple[int, ...] | None:
    """``"0.3.32"`` as ``(0, 3, 32)`` (a suffix such as ``.dev1`` dropped); None: not a
    release number."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(x or 0) for x in m.groups()) if m else None


def known(version: str) -> bool:
    """Whether ``version`` of llama-cpp-python is in the range this module was read from."""
    release = _release(version)
    low, high = (_release(v) for v in KNOWN_VERSIONS)
    return release is not None and low is not None and high is not None and low <= release <= high


def check(llm: llama_cpp.Llama | None = None) -> None:
    """Raise ConfigError if this llama-cpp-python lacks an internal shmkv uses.

    ``llm``: an instance, whose attributes are checked too (the class's methods and the
    C API bindings always are). A version in :data:`KNOWN_VERSIONS`' range is trusted
    without looking.
    """
    global _warned
    version = str(getattr(llama_cpp, "__version__", "unknown"))
    if known(version):
        return
    missing = [f for f in FUNCTIONS if not callable(getattr(lc, f, None))]
    if not callable(getattr(llama_cpp.Llama, COMPLETION, None)):
        missing.append(COMPLETION)
    if llm is not None:
        missing += [a for a in _ATTRIBUTES if not hasattr(llm, a)]
        params = getattr(llm, "context_params", None)
        if not isinstance(getattr(params, "_fields_", None), list):
            missing.append("context_params._fields_")
    oldest, newest = KNOWN_VERSIONS
    if missing:
        raise ConfigError(
            f"llama-cpp-python {version} lacks {', '.join(missing)}, which shmkv uses "
            f"(read from llama-cpp-python {oldest} to {newest}): install one of those, "
            f"pip install '{REQUIREMENT}' (with your CMAKE_ARGS, e.g. -DGGML_CUDA=on, to "
            "keep a GPU build)"
        )
    if not _warned:
        _warned = True
        log.warning(
            "llama-cpp-python %s: shmkv was read against %s to %s; the internals it uses are there",
            version,
            oldest,
            newest,
        )


def requires_eval(llm: llama_cpp.Llama) -> None:
    """The context's cells changed under llama-cpp-python: it must not trust its own
    bookkeeping that the prompt is evaluated (``Llama._requires_eval``, read by
    ``generate`` since 0.3.32; before, ``generate`` always evaluates a prompt's last
    token again, and the attribute is set but never read)."""
    llm._requires_eval = True  # noqa: SLF001


def logits_all(llm: llama_cpp.Llama) -> bool:
    """Whether the context keeps every token's logits (``Llama(logits_all=True)``)."""
    return bool(getattr(llm, "_logits_all", False))


def registered_chat_handler(llm: llama_cpp.Llama) -> Any:
    """The chat handler ``llm`` registered for its ``chat_format`` (a GGUF's own template:
    ``Llama._chat_handlers``), or None."""
    handlers = getattr(llm, "_chat_handlers", None) or {}
    return handlers.get(llm.chat_format or "")


def context_param_names(params: Any) -> list[str]:
    """The field names of a ``llama_context_params`` ctypes structure."""
    return [name for name, *_ in params._fields_]


def completion_signature() -> inspect.Signature:
    """The signature of ``Llama._create_completion`` (its arguments, bound by ``hooks.py``)."""
    return inspect.signature(getattr(llama_cpp.Llama, COMPLETION))


def completion_method(llm: llama_cpp.Llama) -> Callable[..., Iterator[Any]]:
    """``llm``'s ``_create_completion``, which every (chat) completion goes through."""
    method: Callable[..., Iterator[Any]] = getattr(llm, COMPLETION)
    return method


def replace_completion(llm: llama_cpp.Llama, method: Callable[..., Iterator[Any]]) -> None:
    """Replace ``llm``'s ``_create_completion`` (on the instance)."""
    setattr(llm, COMPLETION, method)


def threads_of(llm: Any) -> int | None:
    """The thread count ``cpu.budget.set_threads`` last gave ``llm``'s context (None: not
    known), kept on the ``Llama`` as ``_shmkv_threads`` (set it to None after changing the
    context's threads yourself)."""
    n: int | None = getattr(llm, "_shmkv_threads", None)
    return n


def remember_threads(llm: Any, n: int) -> None:
    """Record the thread count just given ``llm``'s context (see :func:`threads_of`)."""
    llm._shmkv_threads = n  # noqa: SLF001


def mtmd_library(handler: Any) -> Any:
    """The mtmd library module a multimodal chat handler calls through
    (``MTMDChatHandler._mtmd_cpp``, ``Llava15ChatHandler._mtmd_cpp``); None: not one.
    In every known version their ``__call__`` calls ``mtmd_tokenize``, then resets the
    context, then asks ``mtmd_input_chunks_size`` before its decode loop (``mtmd.py``)."""
    return getattr(handler, "_mtmd_cpp", None) if handler is not None else None


def replace_mtmd_library(handler: Any, lib: Any) -> None:
    """Give a multimodal chat handler another mtmd library to call (``mtmd.share``)."""
    handler._mtmd_cpp = lib  # noqa: SLF001


class CompletionOverride:
    """Mixin for a ``Llama`` subclass whose ``shmkv`` cache runs ``_create_completion``
    (``SharedCacheLlama``): the override of that private method, kept here."""

    shmkv: Any

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        plain = super()._create_completion  # type: ignore[misc]
        result: Iterator[Any] = self.shmkv.completion(plain, *args, **kwargs)
        return result
