"""Where level-1 segments close (``memory.build.segments``).

Embeddings are built by hand (unit vectors at chosen angles) so every cosine distance is known:
a shift closes on a clearly different direction and not on a similar one, at exactly the
configured threshold; the token and message caps, tool-family changes, explicit markers and
completion words close where they should (and "not done yet" does not); ``split`` keeps the
remainder open, gives the same cuts in one pass as in several batches, and is fast.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from memory.build.segments import (
    Segment,
    SegmentMessage,
    SegmentPolicy,
    close_reason,
    closes_after,
    split,
    tool_family,
)

E1 = (1.0, 0.0, 0.0)
E2 = (0.0, 1.0, 0.0)
E3 = (0.0, 0.0, 1.0)
POLICY = SegmentPolicy(min_tokens=0)


def at_cosine(c: float) -> tuple[float, float, float]:
    """A unit vector whose cosine with E1 is ``c``."""
    return (c, math.sqrt(1.0 - c * c), 0.0)


_seq = iter(range(1_000_000))


def msg(
    text: str = "some message",
    *,
    role: str = "user",
    emb: Sequence[float] | npt.NDArray[np.floating[Any]] | None = None,
    tokens: int = 10,
    tools: tuple[str, ...] = (),
    seq: int | None = None,
) -> SegmentMessage:
    return SegmentMessage(
        seq=next(_seq) if seq is None else seq,
        role=role,
        text=text,
        token_count=tokens,
        embedding=emb,
        tool_names=tools,
    )


# --- semantic shift -----------------------------------------------------------------------------


def test_shift_closes_on_a_different_direction_not_on_a_similar_one() -> None:
    open_segment = [msg(emb=E1), msg(emb=E1, role="assistant")]
    assert close_reason(open_segment, msg(emb=E2), POLICY) == "shift"
    assert close_reason(open_segment, msg(emb=at_cosine(0.95)), POLICY) is None


@pytest.mark.parametrize(
    ("cosine", "threshold", "expected"),
    [
        (0.70, 0.30, None),  # distance exactly 0.30: not above the threshold
        (0.71, 0.30, None),
        (0.69, 0.30, "shift"),
        (0.50, 0.50, None),
        (0.49, 0.50, "shift"),
        (0.90, 0.05, "shift"),
    ],
)
def test_shift_threshold_is_respected_exactly(
    cosine: float, threshold: float, expected: str | None
) -> None:
    policy = SegmentPolicy(shift_threshold=threshold, min_tokens=0)
    open_segment = [msg(emb=E1), msg(emb=E1)]
    assert close_reason(open_segment, msg(emb=at_cosine(cosine)), policy) == expected


def test_shift_measures_against_the_centroid_of_the_open_segment() -> None:
    # Centroid of E1 and E2 points at 45°: E1 is 0.29 away from it, E3 is 1.0 away.
    open_segment = [msg(emb=E1), msg(emb=E2)]
    assert close_reason(open_segment, msg(emb=E1), POLICY) is None
    assert close_reason(open_segment, msg(emb=E3), POLICY) == "shift"


def test_shift_is_scale_invariant() -> None:
    open_segment = [msg(emb=(5.0, 0.0, 0.0)), msg(emb=(0.1, 0.0, 0.0))]
    assert close_reason(open_segment, msg(emb=(0.0, 7.0, 0.0)), POLICY) == "shift"
    assert close_reason(open_segment, msg(emb=(3.0, 0.5, 0.0)), POLICY) is None


def test_shift_waits_for_min_messages_with_embeddings() -> None:
    assert close_reason([msg(emb=E1)], msg(emb=E2), POLICY) is None
    # Messages without embeddings neither count nor move the centroid.
    assert close_reason([msg(emb=E1), msg(), msg()], msg(emb=E2), POLICY) is None
    assert close_reason([msg(emb=E1), msg(), msg(emb=E1)], msg(emb=E2), POLICY) == "shift"
    assert (
        close_reason([msg(emb=E1)], msg(emb=E2), SegmentPolicy(min_messages=1, min_tokens=0))
        == "shift"
    )


def test_messages_without_embedding_are_never_a_shift() -> None:
    open_segment = [msg(emb=E1), msg(emb=E1)]
    assert close_reason(open_segment, msg(emb=None), POLICY) is None
    assert close_reason(open_segment, msg(emb=(0.0, 0.0, 0.0)), POLICY) is None


def test_no_soft_close_before_a_tool_result() -> None:
    open_segment = [msg(emb=E1), msg(emb=E1, role="assistant", tools=("github_get_pr",))]
    tool_result = msg("## PR #12\n---\nnew topic", role="tool", emb=E2, tools=("jira_search",))
    assert close_reason(open_segment, tool_result, POLICY) is None
    # The caps still apply: a tool result can be arbitrarily large.
    assert close_reason(open_segment, msg(role="tool", tokens=5000), POLICY) == "token_cap"


def test_an_empty_segment_never_closes() -> None:
    assert close_reason([], msg("## New topic", emb=E2, tokens=10_000), POLICY) is None


def test_embeddings_of_another_width_are_an_error() -> None:
    with pytest.raises(ValueError, match="dimensional"):
        close_reason([msg(emb=E1), msg(emb=E1)], msg(emb=(1.0, 0.0)), POLICY)


def test_numpy_embeddings_work_like_lists() -> None:
    open_segment = [msg(emb=np.array(E1, dtype=np.float32)), msg(emb=np.array(E1))]
    assert close_reason(open_segment, msg(emb=np.array(E2, dtype=np.float32)), POLICY) == "shift"
    # list(array) holds numpy scalars, as a row from pgvector turned into a list does.
    scalars = [msg(emb=list(np.array(E1, dtype=np.float32))) for _ in range(2)]
    assert close_reason(scalars, msg(emb=list(np.array(E2, dtype=np.float32))), POLICY) == "shift"
    assert close_reason(scalars, msg(emb=list(np.array(E1, dtype=np.float32))), POLICY) is None


# --- caps ---------------------------------------------------------------------------------------


def test_token_cap() -> None:
    policy = SegmentPolicy(token_cap=100)
    open_segment = [msg(tokens=60), msg(tokens=30)]
    assert close_reason(open_segment, msg(tokens=10), policy) is None  # exactly at the cap
    assert close_reason(open_segment, msg(tokens=11), policy) == "token_cap"


def test_a_message_larger_than_the_cap_gets_a_segment_of_its_own() -> None:
    policy = SegmentPolicy(token_cap=100)
    messages = [msg(tokens=10), msg(tokens=500), msg(tokens=10)]
    closed, rest = split(messages, policy)
    assert [len(s.messages) for s in closed] == [1, 1]
    assert [s.reason for s in closed] == ["token_cap", "token_cap"]
    assert rest == messages[2:]


def test_max_messages() -> None:
    policy = SegmentPolicy(max_messages=3)
    assert close_reason([msg(), msg()], msg(), policy) is None
    assert close_reason([msg(), msg(), msg()], msg(), policy) == "max_messages"


def test_policy_validates_its_values() -> None:
    for bad in (
        {"shift_threshold": -0.1},
        {"shift_threshold": 2.5},
        {"token_cap": 0},
        {"min_messages": 0},
        {"max_messages": 0},
    ):
        with pytest.raises(ValueError):
            SegmentPolicy(**bad)


# --- tool families ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("github_create_issue", "github"),
        ("github.list_prs", "github"),
        ("Jira-Search", "jira"),
        ("mcp__slack__post_message", "slack"),
        ("functions.stripe_refund", "stripe"),
        ("weather", "weather"),
        ("read_file", None),  # a generic verb names no family
        ("get_weather", None),
        ("", None),
    ],
)
def test_tool_family(name: str, family: str | None) -> None:
    assert tool_family(name) == family


def test_tool_family_change_closes() -> None:
    open_segment = [
        msg("open an issue for the crash"),
        msg("", role="assistant", tools=("github_create_issue",)),
        msg('{"number": 12}', role="tool", tools=("github_create_issue",)),
        msg("Created issue #12.", role="assistant"),
    ]
    jira = msg("", role="assistant", tools=("jira_create_ticket",))
    assert close_reason(open_segment, jira, POLICY) == "tool_family"
    same = msg("", role="assistant", tools=("github_add_label",))
    assert close_reason(open_segment, same, POLICY) is None
    # One call of the same family among several is continuity, not a change.
    mixed = msg("", role="assistant", tools=("jira_search", "github_comment"))
    assert close_reason(open_segment, mixed, POLICY) is None
    generic = msg("", role="assistant", tools=("read_file",))
    assert close_reason(open_segment, generic, POLICY) is None
    # Without an earlier tool call there is nothing to change from.
    assert close_reason([msg("hi"), msg("hello", role="assistant")], jira, POLICY) is None


def test_tool_family_compares_with_the_latest_call() -> None:
    open_segment = [
        msg("", role="assistant", tools=("github_get_pr",)),
        msg("", role="assistant", tools=("jira_get_issue",)),
    ]
    assert close_reason(open_segment, msg("", role="assistant", tools=("jira_x",)), POLICY) is None
    assert (
        close_reason(open_segment, msg("", role="assistant", tools=("github_x",)), POLICY)
        == "tool_family"
    )


# --- markers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "text"),
    [
        ("user", "## Deployment\nNow the deploy."),
        ("user", "# Part 2"),
        ("user", "---\nsomething else"),
        ("user", "New topic: billing for INV-2041"),
        ("user", "new task - write the release notes"),
        ("user", "OK, let's move on to the API."),
        ("user", "Let\u2019s move on."),
        ("user", "Switching to the frontend now"),
        ("user", "Thanks! Next question: how do I rotate keys?"),
        ("user", "On a different note, the office is closed Friday."),
        ("user", "**Next task**: migrations"),
        ("assistant", "Moving on to step 2: the schema."),
        ("system", "### Phase 2"),
    ],
)
def test_markers_close_before_the_message(role: str, text: str) -> None:
    open_segment = [msg(), msg(role="assistant")]
    assert close_reason(open_segment, msg(text, role=role), POLICY) == "marker_before"


@pytest.mark.parametrize(
    ("role", "text"),
    [
        ("assistant", "## Summary\nHere is what I found."),  # assistants format answers so
        ("assistant", "---\nresult"),
        ("tool", "# README\n..."),
        ("user", "I think the new topic model is better."),  # not at the start
        ("user", "Next, the logs show a timeout."),
        ("user", "#123 is still failing"),  # an issue reference, not a heading
        ("user", "-- a dash"),
    ],
)
def test_not_markers(role: str, text: str) -> None:
    open_segment = [msg(), msg(role="assistant")]
    assert close_reason(open_segment, msg(text, role=role), POLICY) is None


# --- completion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "text"),
    [
        ("user", "Done."),
        ("user", "done"),
        ("user", "That's all, thanks!"),
        ("user", "Thanks, that works!"),
        ("user", "Thanks, that works \U0001f64f"),
        ("user", "problem solved"),
        ("user", "Perfect \u2014 we\u2019re done here."),
        ("assistant", "Task complete. The report is in reports/q3.pdf."),
        ("assistant", "I've finished the migration and verified the row counts."),
        ("assistant", "\u2705 Merged to main."),
        ("assistant", "I updated the handler. The bug is fixed now."),
        ("assistant", "Here is the diff:\n```\n- a\n+ b\n```\nAll done!"),
    ],
)
def test_completion_closes_after(role: str, text: str) -> None:
    assert closes_after(msg(text, role=role)) == "completion"


@pytest.mark.parametrize(
    ("role", "text"),
    [
        ("user", "It's not done yet"),
        ("user", "it isn't finished"),
        ("user", "Once this is done, we can deploy."),
        ("user", "When you're finished, ping me."),
        ("user", "Is it done?"),
        ("user", "Done. Now, what about the logs?"),  # moves on within the same message
        ("user", "I've done some research; here are three options."),
        ("user", "Almost done."),
        ("assistant", "This will be completed tomorrow."),
        ("assistant", "Let me check how that works."),
        ("assistant", "Resolving the conflict in main.py now."),
        ("tool", "done."),
        ("user", ""),
    ],
)
def test_not_a_completion(role: str, text: str) -> None:
    assert closes_after(msg(text, role=role)) is None


def test_an_assistant_calling_tools_does_not_close() -> None:
    assert closes_after(msg("Done, now fetching.", role="assistant", tools=("get_x",))) is None


def test_only_first_and_last_sentences_count() -> None:
    middle = "I looked at it. Step one is done. Next I will look at the cache layer."
    assert closes_after(msg(middle, role="assistant")) is None
    long_tail = "Here is the plan. " + "More detail follows here. " * 100 + "Everything is done."
    assert closes_after(msg(long_tail, role="assistant")) == "completion"


# --- split --------------------------------------------------------------------------------------


def reasons(segments: Sequence[Segment]) -> list[tuple[int, int, str]]:
    return [(s.seq_start, s.seq_end, s.reason) for s in segments]


def test_split_keeps_the_remainder_open_unless_final() -> None:
    a = [msg(f"about topic a {i}", emb=E1, seq=i) for i in range(4)]
    b = [msg(f"about topic b {i}", emb=E2, seq=4 + i) for i in range(3)]
    closed, rest = split(a + b, POLICY)
    assert reasons(closed) == [(0, 3, "shift")]
    assert closed[0].messages == tuple(a)
    assert rest == b

    closed, rest = split(a + b, POLICY, final=True)
    assert reasons(closed) == [(0, 3, "shift"), (4, 6, "final")]
    assert rest == []


def test_split_closes_after_a_completion() -> None:
    messages = [
        msg("Please rename the column to user_id.", seq=0),
        msg("Renamed it in migration 0042.", role="assistant", seq=1),
        msg("Thanks, that works!", seq=2),
        msg("Another thing: the cron runs twice.", seq=3),
    ]
    closed, rest = split(messages, POLICY)
    assert reasons(closed) == [(0, 2, "completion")]
    assert rest == messages[3:]
    assert split([], POLICY) == ([], [])


def test_segment_exposes_span_and_tokens() -> None:
    segment = Segment((msg(seq=5, tokens=7), msg(seq=6, tokens=8)), "shift")
    assert (segment.seq_start, segment.seq_end, segment.token_count) == (5, 6, 15)


def synthetic_conversation(n: int, dim: int = 16, seed: int = 3) -> list[SegmentMessage]:
    """Messages drifting between topics, with tools, markers, completions and big outputs."""
    rng = random.Random(seed)
    topics = [[rng.gauss(0, 1) for _ in range(dim)] for _ in range(6)]
    topic = 0
    messages = []
    for seq in range(n):
        if rng.random() < 0.04:
            topic = rng.randrange(len(topics))
        role = rng.choice(["user", "assistant", "assistant", "tool"])
        base = topics[topic]
        emb = [x + rng.gauss(0, 0.6) for x in base] if rng.random() < 0.9 else None
        text = rng.choice(
            [
                "Could you look at the failing job?",
                "Here is what I found in the logs.",
                "Thanks, that works!",
                "New topic: the billing export.",
                "It's not done yet.",
                "Done.",
                "Let me check the config.",
            ]
        )
        tools: tuple[str, ...] = ()
        if role == "assistant" and rng.random() < 0.3:
            tools = (rng.choice(["github_get_pr", "jira_search", "read_file", "slack_post"]),)
        messages.append(
            SegmentMessage(
                seq=seq,
                role=role,
                text=text,
                token_count=rng.choice([5, 20, 80, 400, 1500]),
                embedding=emb,
                tool_names=tools,
            )
        )
    return messages


def test_split_in_batches_equals_one_pass() -> None:
    messages = synthetic_conversation(600)
    policy = SegmentPolicy(max_messages=12)
    whole, whole_rest = split(messages, policy)
    assert len(whole) > 50
    assert {s.reason for s in whole} >= {"shift", "completion", "marker_before", "token_cap"}
    rng = random.Random(11)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(messages)), rng.randint(1, 8)))
        closed: list[Segment] = []
        rest: list[SegmentMessage] = []
        for start, end in zip([0, *cuts], [*cuts, len(messages)], strict=True):
            new, rest = split(rest + messages[start:end], policy)
            closed.extend(new)
        assert reasons(closed) == reasons(whole)
        assert [s.messages for s in closed] == [s.messages for s in whole]
        assert rest == whole_rest


def test_split_agrees_with_close_reason_and_closes_after() -> None:
    messages = synthetic_conversation(300, seed=5)
    closed, rest = split(messages, POLICY)
    by_seq = {m.seq: m for m in messages}
    covered = [m for s in closed for m in s.messages] + rest
    assert covered == messages  # every message exactly once, in order
    for segment in closed:
        if segment.reason == "completion":
            assert closes_after(segment.messages[-1]) == "completion"
        else:
            following = by_seq[segment.seq_end + 1]
            assert close_reason(segment.messages, following, POLICY) == segment.reason
        # Nothing closed inside the segment.
        for i in range(1, len(segment.messages)):
            assert close_reason(segment.messages[:i], segment.messages[i], POLICY) is None
            assert closes_after(segment.messages[i - 1]) is None


def test_split_of_10k_messages_keeps_every_message() -> None:
    rng = np.random.default_rng(0)
    topics = rng.normal(size=(25, 384))
    texts = [
        "Can you check why the build for INV-2041 fails on Tuesday?",
        "I looked at the logs: migration 0042 times out after 30 seconds. " * 3,
        "Thanks, that works!",
        "Once this is done, we can deploy to staging.",
    ]
    messages = []
    for seq in range(10_000):
        vector = topics[(seq // 40) % 25] + rng.normal(size=384) * 0.5
        messages.append(
            SegmentMessage(
                seq=seq,
                role="user" if seq % 2 == 0 else "assistant",
                text=texts[seq % len(texts)],
                token_count=40,
                embedding=(vector / np.linalg.norm(vector)).tolist(),
                tool_names=(),
            )
        )
    closed, rest = split(messages, POLICY)
    # Its speed is measured by `bench.throughput` ("segmentation (split)"), not timed here.
    assert sum(len(s.messages) for s in closed) + len(rest) == 10_000
