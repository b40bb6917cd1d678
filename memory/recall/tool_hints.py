"""What a prompt tells the model of the memory tools, and the prompt without it for a turn that
is not offered them.

Stable memory and masked tool results are written once, with their hints ("memory_expand opens
a [#id]", a range "memory_browse … reads", the tools' guide), and kept byte for byte: they are
the working context's prefix. A turn whose request does not offer the memory tools (the
Responses API, `MEMSTRATA_MEMORY_TOOLS=never`, a `tool_choice` that names a function) gets
them with the hints taken out (`without`), the same way on every such turn, so that its prefix
holds too, and the model is never pointed at a tool it cannot call.
"""

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from memory import tokens

GUIDE: Final = (
    "Tools: memory_search finds more, memory_expand opens a [#id], memory_browse lists "
    "summaries, memory_find matches exact text."
)
"""How a memory message tells the model to use the memory tools."""
EXPAND: Final = "; memory_expand opens a [#id]"
"""What a stable-memory message's header says of its `[#id]`s."""
MASKED: Final = ": memory_expand to read"
"""What a masked tool result's placeholder says of the result."""


def browse(first: int, last: int) -> str:
    """What a stable-memory message says of messages `first`-`last` no summary covers yet."""
    return f": memory_browse (level 0, start {first}, end {last}) reads them"


_IN_STABLE = re.compile(
    "|".join(
        (
            re.escape(f" {GUIDE}"),
            re.escape(EXPAND),
            r": memory_browse \(level 0, start \d+, end \d+\) reads them",
        )
    )
)
_PLACEHOLDER = re.compile(r"\[#\d+ tool result, [\d,]+ tokens, masked" + re.escape(MASKED) + r"\]")

Message = dict[str, Any]


def without(
    messages: Sequence[Message], labels: Sequence[str], counts: Sequence[int], *, model: str
) -> tuple[list[Message], list[int]]:
    """`messages` (labelled by `labels`, costing `counts`) with no hint of the memory tools in
    stable memory and masked tool results, and what each then costs."""
    kept, costs = list(messages), list(counts)
    for index, (message, label) in enumerate(zip(messages, labels, strict=True)):
        if label == "stable":
            changed = _edited(message, lambda text: _IN_STABLE.sub("", text))
        elif message.get("role") == "tool" and _PLACEHOLDER.fullmatch(str(message["content"])):
            changed = {**message, "content": message["content"].replace(MASKED, "")}
        else:
            continue
        if changed != message:
            kept[index] = changed
            costs[index] = tokens.count_message(changed, model=model)
    return kept, costs


def _edited(message: Message, edit: Callable[[str], str]) -> Message:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": edit(content)}
    if isinstance(content, list):  # one text part carrying a cache breakpoint
        parts = [
            {**part, "text": edit(part["text"])} if isinstance(part.get("text"), str) else part
            for part in content
        ]
        return {**message, "content": parts}
    return message
