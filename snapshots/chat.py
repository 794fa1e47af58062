"""The chat template: how a list of messages becomes the token ids the model sees.

A message is a dict ``{"role": ROLE, "content": str}`` with ROLE one of ``system``, ``user``,
``assistant``, ``tool_call``, ``tool_result``. The rendering is, in ids::

    <|bos|>
    <|system|> encode(content) <|end|>
    <|user|> encode(content) <|end|>
    <|assistant|> encode(content) <|end|>
    <|tool_call|> encode(content) <|end|>       e.g. content = 'Read({"file_path": "json/decoder.py"})'
    <|tool_result|> encode(content) <|end|>
    ...
    <|assistant|>                               (generation prompt: a request ends here)

Each content is encoded on its own (no merges across a marker), so the token count of a rendering
is ``1 + sum(2 + len(encode(content))) + 1`` and prefixes of a conversation render to prefixes of
its ids (up to the final generation prompt). The model generates the assistant turn and stops at
``<|end|>`` or ``<|eos|>``. A tool call's content is ``name(json_input)`` (`tool_call_content`).
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from . import tokenizer as tk

ROLE_IDS = {
    "system": tk.SYSTEM_ID,
    "user": tk.USER_ID,
    "assistant": tk.ASSISTANT_ID,
    "tool_call": tk.TOOL_CALL_ID,
    "tool_result": tk.TOOL_RESULT_ID,
}
ROLES = tuple(ROLE_IDS)
STOP_IDS = (tk.END_ID, tk.EOS_ID)


class MessageError(ValueError):
    """A message that is not {role: one of ROLES, content: str}."""


def check_message(m: Mapping, where: str = "message") -> None:
    """Refuse (MessageError) anything but a mapping with a known role and string content."""
    if not isinstance(m, Mapping):
        raise MessageError(f"{where}: expected a dict, got {type(m).__name__}")
    if m.get("role") not in ROLE_IDS:
        raise MessageError(f"{where}: unknown role {m.get('role')!r}; expected one of {ROLES}")
    if not isinstance(m.get("content"), str):
        raise MessageError(f"{where}: content must be a string, got {type(m.get('content')).__name__}")


def tool_call_content(name: str, tool_input: object) -> str:
    """The content of a tool_call message: ``name(<input as JSON, keys in given order>)``."""
    return f"{name}({json.dumps(tool_input, ensure_ascii=False)})"


def render_message(m: Mapping, content_ids: list[int] | None = None) -> list[int]:
    """Ids of one message: role marker, content, ``<|end|>`` (content_ids: precomputed encoding)."""
    check_message(m)
    ids = content_ids if content_ids is not None else tk.encode(m["content"])
    return [ROLE_IDS[m["role"]], *ids, tk.END_ID]


def render(messages: Iterable[Mapping], generation_prompt: bool = True) -> list[int]:
    """Ids of a conversation: ``<|bos|>``, each message, then ``<|assistant|>`` if generation_prompt.

    Refuses (MessageError) an unknown role or non-string content, naming the message index.
    """
    messages = list(messages)
    for i, m in enumerate(messages):
        check_message(m, f"message {i}")
    ids = [tk.BOS_ID]
    for m, content_ids in zip(messages, tk.encode_batch([m["content"] for m in messages])):
        ids += render_message(m, content_ids)
    if generation_prompt:
        ids.append(tk.ASSISTANT_ID)
    return ids


def message_tokens(content_len: int) -> int:
    """Tokens one message adds to a rendering, given its content's token count (marker + end)."""
    return content_len + 2


def rendered_length(content_lens: Iterable[int], generation_prompt: bool = True) -> int:
    """Length of `render` output from the messages' content token counts (no re-encoding)."""
    return 1 + sum(message_tokens(n) for n in content_lens) + (1 if generation_prompt else 0)


def render_text(messages: Iterable[Mapping], generation_prompt: bool = True) -> str:
    """The rendering as text for display: same markers and order as `render`.

    A newline follows each ``<|end|>`` for readability; it is display only (not in `render`'s ids).
    """
    out = ["<|bos|>"]
    for i, m in enumerate(messages):
        check_message(m, f"message {i}")
        out.append(f"<|{m['role']}|>{m['content']}<|end|>\n")
    if generation_prompt:
        out.append("<|assistant|>")
    return "".join(out)
