"""Every private name of llama-cpp-python that shmkv uses, in one place.

Runs in a process that holds a ``Llama``. llama-cpp-python has no public way to say
"the context's cells changed under you", to find the chat handler a format name
stands for, to list a context's parameters or to hook the completion that every
``create_completion`` goes through; shmkv reads or replaces these internals, as they
are in the versions in :data:`KNOWN_VERSIONS` (read from ``llama_cpp/llama.py``).
Nothing else in shmkv touches an underscore name of llama-cpp-python; the HTTP side's
(``llama_cpp.server``) are in ``workers/compat.py``.

:func:`check` runs when a cache attaches (``SharedPrefixCache``): on a version not in
:data:`KNOWN_VERSIONS` it verifies that each internal is still there and raises one
:class:`~shmkv.core.errors.ConfigError` naming those missing and the versions known
(it logs a warning once if all are there).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp

from shmkv.core.errors import ConfigError

log = logging.getLogger(__name__)

#: the llama-cpp-python versions whose internals this module was read from
KNOWN_VERSIONS = ("0.3.36",)

#: ``Llama`` methods shmkv hooks (``hooks.py``) or overrides (``SharedCacheLlama``)
COMPLETION = "_create_completion"
#: instance attributes read or written here
_ATTRIBUTES = ("_requires_eval", "_chat_handlers", "_logits_all", "_ctx")

_warned = False


def check(llm: llama_cpp.Llama | None = None) -> None:
    """Raise ConfigError if this llama-cpp-python lacks an internal shmkv uses.

    ``llm``: an instance, whose attributes are checked too (the class's methods
    always are). A known version is trusted without looking.
    """
    global _warned
    version = str(getattr(llama_cpp, "__version__", "unknown"))
    if version in KNOWN_VERSIONS:
        return
    missing = [] if callable(getattr(llama_cpp.Llama, COMPLETION, None)) else [COMPLETION]
    if llm is not None:
        missing += [a for a in _ATTRIBUTES if not hasattr(llm, a)]
        params = getattr(llm, "context_params", None)
        if not isinstance(getattr(params, "_fields_", None), list):
            missing.append("context_params._fields_")
    if missing:
        raise ConfigError(
            f"llama-cpp-python {version} lacks {', '.join(missing)}, which shmkv uses "
            f"(read from llama-cpp-python {', '.join(KNOWN_VERSIONS)}): install "
            f"llama-cpp-python=={KNOWN_VERSIONS[-1]}"
        )
    if not _warned:
        _warned = True
        log.warning(
            "llama-cpp-python %s: shmkv was read against %s; the internals it uses are there",
            version,
            ", ".join(KNOWN_VERSIONS),
        )


def requires_eval(llm: llama_cpp.Llama) -> None:
    """The context's cells changed under llama-cpp-python: it must not trust its own
    bookkeeping that the prompt is evaluated (``Llama._requires_eval``)."""
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


class CompletionOverride:
    """Mixin for a ``Llama`` subclass whose ``shmkv`` cache runs ``_create_completion``
    (``SharedCacheLlama``): the override of that private method, kept here."""

    shmkv: Any

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        plain = super()._create_completion  # type: ignore[misc]
        result: Iterator[Any] = self.shmkv.completion(plain, *args, **kwargs)
        return result
