"""How much a message matters later: a score in [0, 1]; at `MILESTONE` or above it is pinned.

The score is a cheap, deterministic reading of the text, taken once when a message is first
processed: explicit requests to remember weigh most, then decisions and commitments, then the
concrete details people ask about later (identifiers, numbers, dates). Pinned messages are
offered verbatim in every rebuilt prompt, so the bar for a milestone is deliberately high.
"""

import re
from typing import Final

from memory.text import MONTHS, WEEKDAYS

MILESTONE: Final = 0.8

_REMEMBER = re.compile(
    # "important" only before its colon: the closing \b after a colon needs a word next
    # ("important:x"), so "important: ..." as people write it never counted.
    r"\b(remember( that| this)?|don'?t forget|do not forget|note that|keep in mind|"
    r"important(?=:)|for the record|my (name|birthday|address|email|phone) is)\b",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(we (decided|agreed|chose|will go with)|decided to|agreed (to|on)|final (answer|decision)|"
    r"let'?s go with|approved|signed off|deadline|committed to|the plan is)\b",
    re.IGNORECASE,
)
_IDENTIFIER = re.compile(
    # "#1234" outside the leading \b, which before a "#" needs a word right before it: "ticket
    # #1234", as people write it, never counted.
    r"(\b([A-Z]{2,}-\d+|[0-9a-f]{7,40}|[\w.+-]+@[\w-]+\.[\w.]+|https?://\S+)|#\d+)\b"
)
_NUMBER = re.compile(r"\b\d[\d,.:/-]*\b")
_MONTH_PREFIXES = "|".join(month[:3] for month in MONTHS)  # jan|feb|...|dec
_WEEKDAY_STEMS = "|".join(day.removesuffix("day") for day in WEEKDAYS)  # mon|tues|...|sun
_DATE = re.compile(
    rf"\b(\d{{4}}-\d{{2}}-\d{{2}}|({_MONTH_PREFIXES})[a-z]*\.? \d{{1,2}}|"
    rf"({_WEEKDAY_STEMS})day|tomorrow|next week)\b",
    re.IGNORECASE,
)


def score(role: str | None, text: str) -> float:
    """The importance of one message."""
    if not text or role in ("system", "developer"):
        return 0.0
    value = 0.1
    if _REMEMBER.search(text):
        value += 0.6
    if _DECISION.search(text):
        value += 0.35
    if _IDENTIFIER.search(text):
        value += 0.15
    if _DATE.search(text):
        value += 0.1
    if _NUMBER.search(text):
        value += 0.05
    # The user's own statements are what they will ask about; tool output rarely is.
    if role == "user":
        value += 0.05
    elif role == "tool":
        value -= 0.1
    return round(min(max(value, 0.0), 1.0), 3)


def is_milestone(value: float) -> bool:
    return value >= MILESTONE
