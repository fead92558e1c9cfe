"""The chat template `shmkv serve` gives the default model: Gemma 3's own, as published.

Runs wherever prompts are rendered the way the served workers render them: in each
gunicorn worker (``workers/app.py``) and in ``shmkv warm`` and ``shmkv export``
(``shmkv/serving/model_settings.py``), so that a warmed or exported chat prompt is token for token
the prompt a served request sends. Needs only llama-cpp-python (its Jinja2 formatter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_cpp.llama_chat_format import (
    Jinja2ChatFormatter,
    LlamaChatCompletionHandlerNotFoundException,
    get_chat_completion_handler,
    register_chat_format,
)

from shmkv.serving.default_model import DEFAULT_MODEL_FILE

# Gemma 3's own chat template, as published with the model (tokenizer_config.json of
# google/gemma-3-*-it). Unlike llama-cpp-python's "gemma" format, which drops system
# messages, it puts the system message at the start of the first user turn.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
GEMMA3_FORMAT = "shmkv-gemma3"


def _text(content: Any) -> str:
    """A message's content as text (a list of parts: its text parts, in order)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(
        str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
    )


def gemma3_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as Gemma 3's template accepts them, none left out.

    The template takes one leading system message and strictly alternating user and
    model turns, starting with the user's; it raises otherwise, and drops a system
    message with no user turn after it. So: leading system (and developer) messages are
    joined into one; a later one, and any other role (tool, function), speaks as the
    user; consecutive turns of one side are joined; a conversation that does not start
    with the user's turn gets an empty one. A conversation the template accepts as it
    is stays as it is.
    """
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for m in messages:
        role, text = m.get("role"), _text(m.get("content"))
        if role in ("system", "developer") and not turns:
            system.append(text)
            continue
        side = "assistant" if role == "assistant" else "user"
        if turns and turns[-1][0] == side:
            turns[-1] = (side, turns[-1][1] + "\n\n" + text)
        else:
            turns.append((side, text))
    if (system or turns) and (not turns or turns[0][0] != "user"):
        turns.insert(0, ("user", ""))
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": "\n\n".join(system)})
    out += [{"role": side, "content": text} for side, text in turns]
    return out


class Gemma3Formatter(Jinja2ChatFormatter):
    """Gemma 3's template over :func:`gemma3_messages`."""

    def __init__(self) -> None:
        super().__init__(template=GEMMA3_TEMPLATE, eos_token="<end_of_turn>", bos_token="<bos>")

    def __call__(self, *, messages: Any, **kwargs: Any) -> Any:
        normalized: Any = gemma3_messages(list(messages))
        return super().__call__(messages=normalized, **kwargs)


def gemma3_formatter() -> Jinja2ChatFormatter:
    return Gemma3Formatter()


def register_gemma3() -> None:
    """Register Gemma 3's template as llama-cpp-python chat format ``shmkv-gemma3``."""
    try:
        get_chat_completion_handler(GEMMA3_FORMAT)
    except LlamaChatCompletionHandlerNotFoundException:  # not yet, in this process
        register_chat_format(GEMMA3_FORMAT)(gemma3_formatter())


def default_chat_format(model: str) -> str | None:
    """The packaged Gemma GGUF carries no chat template: Gemma 3's own, registered here
    (llama-cpp-python would fall back to llama-2's, and its "gemma" format drops system
    messages). Other models: from their GGUF."""
    return GEMMA3_FORMAT if Path(model).name == DEFAULT_MODEL_FILE else None
