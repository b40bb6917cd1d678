"""Where a history goes in its conversation: what identifying it finds
(`memory.write.identity`), and what storing it acts on (`memory.write.store`)."""

from dataclasses import dataclass

from memory.db import AnyRow
from memory.write import chains


@dataclass(frozen=True)
class Branch:
    """How the current branch changes before the new messages are stored: it keeps its
    messages up to `fork_seq` (None: none) and continues with the superseded messages `restore`;
    its other messages after `fork_seq` are superseded."""

    fork_seq: int | None
    restore: tuple[int, ...] = ()


@dataclass(frozen=True)
class Found:
    """The conversation a history belongs to, locked until the transaction ends."""

    row: AnyRow
    """The conversation's row as locked (`memory.schema.conversations`), with the request key
    of its head message (`head_request`) and whether that is a recorded reply
    (`head_replied`)."""
    start: int
    """Where the history's new messages start."""
    created: bool
    parent: str = chains.ROOT_HASH
    """The chain hash the new messages (and then the reply) continue from."""
    parent_seq: int | None = None
    """The seq of that message (None: the conversation's root)."""
    branch: Branch | None = None
    """Set when the history leaves the current branch."""
    whole: bool = False
    """The history's messages before `start` are the whole current branch (once `branch` is
    applied): the request resent the history rather than only its new messages."""
    system_prompt: int = 0
    """How many of the new messages (from `start`) are a system prompt the request led with in
    place of the conversation's (`memory.write.system_prompts`): kept, never a turn."""
    retry: bool = False
    """The request repeats an earlier one: nothing is stored, and nothing branches but a cut
    answer to it that is the head (superseded: `branch`)."""
