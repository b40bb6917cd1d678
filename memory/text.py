"""Text utilities shared by every path: word lists, the sentence splitter, and escaping the text
Postgres cannot hold.

Pure, deterministic, no I/O.

**Word lists.** Each list is named for what it is for. A class of words that several lists take
whole or nearly whole (months, weekdays, days relative to today, modal verbs, question words,
titles, open markers) is written once, and those lists are explicit unions and differences of
the classes and of their own words. Lists for different uses still share a few single words
("if", "before", "still", in different cases): each list is tuned to its own use, and a class
made of such words would tie a change for one use to the others. Lists of capitalised words
(:data:`NAME_STOPWORDS`, :data:`SENTENCE_OPENERS`) hold the words as they are written at the
start of a sentence or inside a name.

**Sentence splitter.** :func:`sentence_starts` and :func:`split_sentences` cut a text after
every sentence end. A line break always ends a sentence; a ``.``, ``!``, ``?`` or ``…`` ends one

* by default, where whitespace follows it ("plan. then" is two sentences; fast, and right for
  chat, where sentences often start in lower case);
* with ``prose=True``, where optional closing quotes or brackets, whitespace and a character
  other than a lower-case letter follow it, and for ``.`` only where it does not close one of
  :data:`ABBREVIATIONS` or a dotted initialism such as "e.g." ("Dr. Jane Smith" is one
  sentence, "plan. then" too).

A sentence runs from one start to the next: the whitespace after a sentence end, and with
``prose=True`` the closing quotes too, belong to the next sentence; :func:`split_sentences`
strips them. ``memory.build.facts`` reads with ``prose=True`` (a wrong cut moves facts to the
wrong sentence); ``memory.build.passages`` and ``memory.build.segments`` with the default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

__all__ = [
    "ABBREVIATIONS",
    "COMPLETION_NEGATORS",
    "CONCEPT_STOPWORDS",
    "GENERIC_TOOL_VERBS",
    "MODAL_VERBS",
    "MONTHS",
    "MONTH_ABBREVIATIONS",
    "MONTH_FORMS",
    "NAME_STOPWORDS",
    "OPEN_MARKERS",
    "QUESTION_WORDS",
    "RELATIVE_DAYS",
    "SENTENCE_OPENERS",
    "TITLES",
    "WEEKDAYS",
    "sentence_starts",
    "split_sentences",
]


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _capitalised(words: Iterable[str]) -> frozenset[str]:
    return frozenset(word.capitalize() for word in words)


# --- word classes -------------------------------------------------------------------------------

MONTHS: Final = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
"""The months in calendar order: a month's number is its index + 1."""

MONTH_ABBREVIATIONS: Final = (
    "jan",
    "feb",
    "mar",
    "apr",
    "jun",
    "jul",
    "aug",
    "sept",
    "sep",
    "oct",
    "nov",
    "dec",
)
"""Short forms of the months ("may" has none), each before its own shorter form."""

MONTH_FORMS: Final = (*MONTHS, *MONTH_ABBREVIATIONS)
"""Every spelling of a month, each before its shorter forms: an alternation of them, in this
order, matches the longest form at a position."""

WEEKDAYS: Final = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

RELATIVE_DAYS: Final = ("yesterday", "today", "tomorrow", "tonight")
"""Days named relative to the day a message was written."""

MODAL_VERBS: Final = _words("can could may might must shall should will would")

QUESTION_WORDS: Final = _words("how what when where which who why")

TITLES: Final = ("Dr", "Mr", "Mrs", "Ms", "Prof", "Sr", "Jr", "St")
"""Titles before a name, as written; they end in a full stop that does not end a sentence."""

OPEN_MARKERS: Final = ("TBD", "TODO", "FIXME")
"""Upper-case words that mark something still open."""

# --- lists, each for one use --------------------------------------------------------------------

CONCEPT_STOPWORDS: Final = _words(
    # Postgres's English stop words (the Snowball list its full-text search drops), so that
    # the concept graph's words are those the full-text leg indexes; then the chat's own
    # filler: greetings, reactions, hedges and the commonest verbs of talk.
    """
    i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who whom
    this that these those am is are was were be been being have has had having do does did
    doing a an the and but if or because as until while of at by for with about against between
    into through during before after above below to from up down in out on off over under again
    further then once here there when where why how all any both each few more most other some
    such no nor not only own same so than too very s t can will just don should now
    hey hi hello thanks thank yeah yes yep wow oh ok okay lol haha cool nice great good awesome
    amazing glad sure really totally definitely absolutely maybe also still even much many lot
    lots thing things something anything everything stuff way ways kind sort bit
    would could might must shall get gets got getting go goes going gone went make makes made
    making know knew think thought feel felt like liked want wanted say said tell told see saw
    look looks looking sounds sound seem seems let take took come came keep kept give gave
    one ones two first last new next day days time times today yesterday tomorrow week weeks
    """
)
"""Words that are never part of a concept's name (`memory.concepts.phrases`)."""


ABBREVIATIONS: Final = (*TITLES, "vs", "etc", "approx", "Inc", "Ltd", "Co", "Corp", "No", "Fig")
"""Words whose full stop does not end a sentence (``split_sentences(..., prose=True)``)."""

NAME_STOPWORDS: Final = (
    _words(
        """
        I I'm I've I'll I'd A An The This That These Those It It's Its We We're We'll You
        You're Your He She They Them Their My Our Me Us Let Let's If While So But And Or Also
        Then Here There Yes No Not OK Ok Okay Hi Hello Hey Thanks Thank Please Sure Great Good
        Done Note Sorry Maybe Just Now Well Oh Yeah Yep API APIs JSON HTTP HTTPS URL URLs SQL
        CPU GPU RAM FYI ETA PR ID IDs UI UX CLI SDK CSV PDF HTML CSS XML YAML ASAP EOD EOW IMO
        IIRC BTW LLM AI DB OS VM DNS TLS SSL SSH UTC GMT NB PS
        """
    )
    | _capitalised(QUESTION_WORDS)
    | frozenset(OPEN_MARKERS)
    | frozenset(TITLES)
)
"""Capitalised words that are no name, dropped from either end of a run of capitalised words
(``memory.build.facts``)."""

SENTENCE_OPENERS: Final = (
    _words(
        """
        About After Again All Although Another Any Anyway As At Because Before Both By Dear
        During Each Either Even Every Finally First For From Had Has Have Having However In
        Instead Is Last Later Like Many Meanwhile More Most Much Neither Next Nor Of On Once One
        Only Other Over Per Perhaps Plus Since Some Still Such Than Thus To Under Unless Until
        Upon Was Were Whether With Within Without Yet Ask Call Contact Email Invite Message Meet
        Ping Remind Send Tell Text Welcome Congrats Congratulations Happy Did Does Do Are Am Be
        Been Being Went Met Saw Told Asked
        """
    )
    | _capitalised(MODAL_VERBS)
    | _capitalised(RELATIVE_DAYS)
)
"""Words capitalised only because they open a sentence: before a name there ("Yesterday
Caroline said", "Ask Bob") they are dropped from it, while any other first word of a run of
capitalised words is a name's ("Caroline Smith said"; ``memory.build.facts``). The words of
:data:`NAME_STOPWORDS` are not repeated here: those are dropped wherever they stand."""

COMPLETION_NEGATORS: Final = (
    _words(
        """
        not no never nothing none nor yet once whenever if unless until till before after
        almost nearly hardly barely still whether cannot to be gonna going need needs needed
        want wants wanted try trying hope hopefully see check test verify confirm sure ensure
        """
    )
    | (MODAL_VERBS - {"shall"})
    | (QUESTION_WORDS - {"who"})
)
"""Words that, a few words before a completion phrase ("done", "that works"), make it not (yet)
a completion (``memory.build.segments``). Not "shall" nor "who": they were never listed, and
adding them would change where segments close."""

GENERIC_TOOL_VERBS: Final = _words(
    """
    get set put post read write list create update delete remove add edit modify apply run exec
    execute call fetch search find query lookup look open close save load send make do check view
    show print compute calculate generate convert parse format upload download insert replace
    move copy rename start stop submit
    """
)
"""Verbs that open tool names of no product family: ``read_file``, ``get_weather``
(``memory.build.segments``)."""


# --- sentences ----------------------------------------------------------------------------------

_LOOSE_END = re.compile(r"[.!?…\n](?:(?<=\n)|(?=\s))")
# With prose=True, what must follow an end mark: closing quotes or brackets, whitespace and no
# lower-case letter. Both patterns start with a character class, so the engine skips quickly to
# the candidates (see the note on speed in memory.build.facts).
_NEXT_SENTENCE = r"(?=[\"')\]]*\s+[^a-z\s])"
_PROSE_END = re.compile(
    r"[.!?…\n](?:(?<=\n)|(?<=[!?…])"
    + _NEXT_SENTENCE
    + r"|(?<=\.)"
    + "".join(rf"(?<!\b{abbreviation}\.)" for abbreviation in ABBREVIATIONS)
    + r"(?<!\b[a-zA-Z]\.[a-zA-Z]\.)"
    + _NEXT_SENTENCE
    + ")"
)


def sentence_starts(text: str, *, prose: bool = False) -> list[int]:
    """Where the sentences of ``text`` start: 0, then the position right after every sentence
    end (see the module docstring for both rules). Sentence ``i`` is ``text[starts[i]:
    starts[i + 1]]``, the last one runs to the end; with whitespace around it, and empty or
    blank where two ends follow each other ("\\n\\n")."""
    end = _PROSE_END if prose else _LOOSE_END
    return [0, *(match.end() for match in end.finditer(text))]


def split_sentences(text: str, *, prose: bool = False) -> list[str]:
    """The sentences of ``text`` in order, stripped; blank ones left out."""
    starts = sentence_starts(text, prose=prose)
    ends = [*starts[1:], len(text)]
    return [
        sentence
        for start, end in zip(starts, ends, strict=True)
        if (sentence := text[start:end].strip())
    ]


# -- text Postgres cannot hold --------------------------------------------------------------


def escape_unstorable(value: Any) -> tuple[Any, bool]:
    """`value` (a string, or lists and objects of them) with the text Postgres refuses made
    storable, and whether anything was: a NUL becomes the six characters `\\u0000` and an
    unpaired surrogate its `\\udXXX` escape, so nothing of an upstream's answer is lost."""
    if isinstance(value, str):
        if "\x00" not in value and value.isascii():
            return value, False
        escaped = value.replace("\x00", "\\u0000")
        escaped = escaped.encode("utf-8", "backslashreplace").decode("utf-8")
        return escaped, escaped != value
    if isinstance(value, list):
        items = [escape_unstorable(item) for item in value]
        return [item for item, _ in items], any(changed for _, changed in items)
    if isinstance(value, dict):
        pairs = [(escape_unstorable(k), escape_unstorable(v)) for k, v in value.items()]
        changed = any(key[1] or item[1] for key, item in pairs)
        return {key[0]: item[0] for key, item in pairs}, changed
    return value, False
