"""The memory message's text: summaries, milestones and retrieved messages, and their costs.

`MemoryBlock` collects the parts `memory.recall.prompt.build` chooses, estimates what each costs in
tokens before it is added (so that the builder can fill its budget greedily), and renders:

    Summaries, oldest first:
    [#812 level 2, messages 0-511, until 2025-03-02 Sun] narrative, cut to a few sentences …
    Milestones:
    2025-03-01 Sat 09:14:
    [#34 user] Remember that the door code is 5821.
    Earlier messages:
    2025-03-01 Sat 11:30:
    [#151 user] The storage unit door code is 5821-KESTREL, remember that.
    [#152 assistant] Noted.

Messages are verbatim (tool calls rendered as `[called name(arguments)]`, tool results as
`[result of call_id]`), tagged with their node id and speaker (`name`, else role), in time
order under one heading per sitting (same conversation, same day, no gap over `SITTING_GAP`)
that gives its date and the time it began: a message's time is its sitting's to within minutes,
and a heading per sitting costs a fraction of a time per message.
Messages of other conversations (the same user's) say so in their tag. Estimates may be off
by a few tokens; the builder's final exact count corrects them (`drop_weakest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime, timedelta
from typing import Any, Final

from memory import tokens
from memory.recall.retrieval import Hit

__all__ = ["SITTING_GAP", "MemoryBlock"]

SITTING_GAP: Final = timedelta(minutes=30)
"""Retrieved messages closer in time than this share one heading with their date and times."""


class MemoryBlock:
    """The memory message's sections, their token costs, and how to shrink them."""

    def __init__(self, *, enc: Any, primary: int) -> None:
        self.enc = enc
        self.primary = primary
        self.summaries: list[tuple[Hit, str]] = []
        self.milestones: list[Hit] = []
        self.messages: list[Hit] = []
        self.lines: dict[int, str] = {}
        self.costs: dict[int, int] = {}
        self.scores: dict[int, float] = {}  # what `drop_weakest` goes by, per message
        self.summary_ids: set[int] = set()
        self.message_ids: set[int] = set()
        self.days: set[tuple[int, date, int]] = set()  # sittings with a heading
        self.piece_tokens: dict[str, int] = {}
        self.summary_lines: dict[tuple[int, int], tuple[str, int]] = {}
        self.summary_cost = 0
        self.milestone_cost = 0
        self.message_cost = 0

    @property
    def total(self) -> int:
        # Section headings cost a few tokens each.
        return self.summary_cost + self.milestone_cost + self.message_cost + 24

    def _count(self, line: str) -> int:
        return len(self.enc.encode_ordinary(line)) + 1

    def _estimate(self, hit: Hit) -> int:
        """A message line's tokens from its stored count (framing, role and name out, the tag
        in): encoding every candidate would cost more than the estimate's error, which the
        final exact count corrects."""
        if hit.level > 0 or hit.tool_calls or hit.role == "tool" or hit.token_count <= 0:
            return self._count(self._message_line(hit))
        speaker = hit.name or hit.role or "?"
        framing = tokens.TOKENS_PER_MESSAGE + self._cached(hit.role or "")
        if hit.name:
            framing += tokens.TOKENS_PER_NAME + self._cached(hit.name)
        where = "" if hit.conversation_id == self.primary else ", other conversation"
        # The tag `[#id speaker]` costs its opening, its id's digits and the rest, each counted
        # once per prompt: both encodings the gateway uses (o200k_base, cl100k_base) split digits
        # into runs of at most three, each one token, so only the id's length varies.
        digits = -(-len(str(hit.node_id)) // 3)
        tag = self._cached("[#") + digits + self._cached(f" {speaker}{where}]")
        return max(1, hit.token_count - framing) + tag + 1

    def _cached(self, piece: str) -> int:
        found = self.piece_tokens.get(piece)
        if found is None:
            found = self.piece_tokens[piece] = len(self.enc.encode_ordinary(piece))
        return found

    def _summary_line(self, hit: Hit, cap: int) -> tuple[str, int]:
        """A summary's line and its cost; costed first, then added: encoded once."""
        found = self.summary_lines.get((hit.node_id, cap))
        if found is not None:
            return found
        ids = self.enc.encode_ordinary(hit.text)
        body = hit.text if len(ids) <= cap else self.enc.decode(ids[:cap]).rstrip() + " …"
        where = "" if hit.conversation_id == self.primary else " other conversation,"
        line = (
            f"[#{hit.node_id} level {hit.level},{where} messages {hit.span_start}-{hit.span_end},"
            f" until {_day(hit.created_at)}] {body}"
        )
        found = self.summary_lines[(hit.node_id, cap)] = (line, self._count(line))
        return found

    def _message_line(self, hit: Hit) -> str:
        speaker = hit.name or hit.role or "?"
        where = "" if hit.conversation_id == self.primary else ", other conversation"
        return f"[#{hit.node_id} {speaker}{where}] {_message_text(hit)}"

    def cost_of_summary(self, hit: Hit, *, cap: int) -> int:
        return self._summary_line(hit, cap)[1]

    def cost_of_message(self, hit: Hit) -> int:
        cost = self._estimate(hit)
        if _sitting(hit) not in self.days:
            cost += 13  # its sitting's heading
        return cost

    def add_summary(self, hit: Hit, *, cap: int) -> None:
        line, cost = self._summary_line(hit, cap)
        self.summaries.append((hit, line))
        self.summary_ids.add(hit.node_id)
        self.lines[hit.node_id] = line
        self.costs[hit.node_id] = cost
        self.summary_cost += cost

    def add_milestone(self, hit: Hit) -> None:
        self.milestone_cost += self.cost_of_message(hit)
        self.milestones.append(hit)
        self.message_ids.add(hit.node_id)
        self.days.add(_sitting(hit))

    def add_message(self, hit: Hit, *, cost: int, score: float | None = None) -> None:
        """Add a retrieved message whose `cost_of_message` was just asked (`cost`: a few hundred
        candidates a prompt are costed, and each estimate encodes its tag); `drop_weakest` goes
        by `score`, the hit's own when None."""
        self.messages.append(hit)
        self.message_ids.add(hit.node_id)
        self.days.add(_sitting(hit))
        self.costs[hit.node_id] = cost
        self.scores[hit.node_id] = hit.score if score is None else score
        self.message_cost += cost

    def drop_weakest(self, over: int = 1) -> bool:
        """Remove the lowest-scored retrieved messages until their estimated cost reaches
        `over` tokens (else the last milestone, else the last summary); False when there is
        nothing left to remove."""
        if self.messages:
            freed = 0
            scores = self.scores
            for weakest in sorted(
                self.messages, key=lambda hit: (scores[hit.node_id], hit.node_id)
            ):
                self.messages.remove(weakest)
                self.message_ids.discard(weakest.node_id)
                cost = self.costs.get(weakest.node_id, 0)
                self.message_cost -= cost
                freed += cost
                if freed >= over:
                    break
            return True
        if self.milestones:
            dropped = self.milestones.pop()
            self.message_ids.discard(dropped.node_id)
            return True
        if self.summaries:
            hit, _ = self.summaries.pop()
            self.summary_ids.discard(hit.node_id)
            self.summary_cost -= self.costs.get(hit.node_id, 0)
            return True
        return False

    def render(self) -> str:
        parts: list[str] = []
        if self.summaries:
            parts.append("Summaries, oldest first:")
            ordered = sorted(self.summaries, key=lambda item: (item[0].span_start, -item[0].level))
            parts.extend(line for _, line in ordered)
        if self.milestones:
            parts.append("Milestones:")
            parts.extend(self._day_grouped(self.milestones))
        if self.messages:
            parts.append("Earlier messages:")
            parts.extend(self._day_grouped(self.messages))
        return "\n".join(parts)

    def _day_grouped(self, hits: Sequence[Hit]) -> list[str]:
        """Messages in time order under one heading per sitting (same day, no gap over
        `SITTING_GAP`) that gives its date and the time it began."""
        ordered = sorted(
            hits, key=lambda hit: (hit.conversation_id != self.primary, hit.created_at, hit.seq)
        )
        groups: list[list[Hit]] = []
        for hit in ordered:
            last = groups[-1][-1] if groups else None
            if (
                last is None
                or last.conversation_id != hit.conversation_id
                or last.created_at.date() != hit.created_at.date()
                or hit.created_at - last.created_at > SITTING_GAP
            ):
                groups.append([hit])
            else:
                groups[-1].append(hit)
        lines: list[str] = []
        for group in groups:
            lines.append(f"{_day(group[0].created_at)} {_clock(group[0].created_at)}:")
            lines.extend(self._message_line(hit) for hit in group)
        return lines


def _sitting(hit: Hit) -> tuple[int, date, int]:
    """The hour a message was written in, for whether its sitting has a heading yet (an
    estimate: computed for every candidate, so without formatting a date)."""
    return hit.conversation_id, hit.created_at.date(), hit.created_at.hour


def _day(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %a")


def _clock(moment: datetime) -> str:
    return moment.strftime("%H:%M")


def _message_text(hit: Hit) -> str:
    text = hit.text
    calls = hit.tool_calls or []
    if calls:
        rendered = []
        for call in calls:
            function = call.get("function") or {} if isinstance(call, dict) else {}
            rendered.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
        text = (text + " " if text else "") + "[called " + "; ".join(rendered) + "]"
    if hit.role == "tool" and hit.tool_call_id:
        text = f"[result of {hit.tool_call_id}] {text}"
    return text.strip()
