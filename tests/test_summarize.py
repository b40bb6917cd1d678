"""Summaries that keep identifiers, numbers, names, dates and decisions
(``memory.build.summarize``).

Extractive mode is checked on hand-written conversations: the sentence holding an id and a
number beats filler, facts come from all the text (not only the kept sentences), the narrative
fits the token budget, children's facts are merged at level 2, and it is fast. LLM mode runs
against the real fake upstream (``devkit.upstream_server`` in a subprocess): the request it
receives, the parsing of plain, fenced and prose-wrapped JSON, and failures as ProviderError.
Auto mode falls back to extractive on a failing upstream and says so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest

from devkit.service import free_port
from devkit.upstream import UpstreamServer
from memory.build.facts import FACT_KEYS, extract_facts
from memory.build.summarize import (
    ExtractiveSummarizer,
    FallbackSummarizer,
    LLMSummarizer,
    Summary,
    SummaryInput,
    make_summarizer,
)
from memory.errors import ProviderError
from memory.provider import Provider
from memory.tokens import count_text

T0 = datetime(2024, 3, 4, 9, 30, tzinfo=UTC)


def message(node_id: int, role: str, text: str) -> SummaryInput:
    return SummaryInput(
        node_id=node_id,
        level=0,
        role=role,
        text=text,
        facts=None,
        created_at=T0 + timedelta(minutes=node_id),
        seq_start=node_id,
        seq_end=node_id,
    )


FILLER = [
    "I hope you are having a lovely afternoon.",
    "That sounds good to me, honestly.",
    "Thanks a lot for the help with everything.",
]
KEY = "Invoice INV-2041 was charged 249.50 EUR twice."

CONVERSATION = [
    message(
        1, "user", "Hi! Can you find out why invoice INV-2041 for Acme Corp was charged twice?"
    ),
    message(
        2,
        "assistant",
        "Sure, let me take a look. The billing log /var/log/billing/charges.log shows two "
        "charges of $1,249.50, 14 seconds apart. The retry in retry_policy.py fired after a "
        "30 s timeout, introduced by commit 3fa9c21e.",
    ),
    message(3, "user", "Ugh, what a week. Honestly I am tired of this."),
    message(4, "assistant", "I understand, that sounds frustrating."),
    message(
        5,
        "user",
        "We decided to refund the duplicate and ask Maria Lopez to confirm by 2024-03-08. "
        "Please email billing@acme.example too.",
    ),
    message(
        6,
        "assistant",
        "Done: refund re_9f8e7d6c issued. Maria will confirm on Friday. "
        "Should I also disable retries for non-idempotent calls?",
    ),
]


# --- extractive ---------------------------------------------------------------------------------


async def test_extractive_keeps_the_fact_sentence_over_filler() -> None:
    items = [
        message(1, "user", f"{FILLER[0]} {FILLER[1]}"),
        message(2, "assistant", f"{FILLER[2]} {KEY}"),
        message(3, "user", FILLER[1]),
    ]
    summary = await ExtractiveSummarizer().summarize(items, level=1, target_tokens=25)
    assert summary.text == f"assistant: {KEY}"
    assert summary.method == "extractive"
    assert summary.model is None
    assert "INV-2041" in summary.facts["identifiers"]
    assert "249.50 EUR" in summary.facts["numbers"]


async def test_extractive_facts_cover_all_the_text_not_only_kept_sentences() -> None:
    summary = await ExtractiveSummarizer().summarize(CONVERSATION, level=1, target_tokens=30)
    assert count_text(summary.text, model="gpt-4o") <= 30
    facts = summary.facts
    assert list(facts) == list(FACT_KEYS)
    for identifier in (
        "INV-2041",
        "/var/log/billing/charges.log",
        "retry_policy.py",
        "3fa9c21e",
        "billing@acme.example",
        "re_9f8e7d6c",
    ):
        assert identifier in facts["identifiers"]
    assert {"$1,249.50", "14 seconds", "30 s"} <= set(facts["numbers"])
    assert {"2024-03-08", "Friday"} <= set(facts["dates"])
    assert {"Acme Corp", "Maria Lopez"} <= set(facts["names"])
    assert any("decided to refund" in d for d in facts["decisions"])
    assert facts["open_questions"] == ["Should I also disable retries for non-idempotent calls?"]
    # The facts are not strings of the kept sentences only: the budget kept just a few.
    assert "billing@acme.example" not in summary.text


async def test_extractive_keeps_original_order_and_role_prefixes() -> None:
    summary = await ExtractiveSummarizer().summarize(CONVERSATION, level=1, target_tokens=120)
    lines = summary.text.splitlines()
    assert all(line.split(": ", 1)[0] in ("user", "assistant") for line in lines)
    positions = [
        summary.text.index(s)
        for s in ("INV-2041", "retry_policy.py", "Maria Lopez", "re_9f8e7d6c")
        if s in summary.text
    ]
    assert len(positions) >= 3
    assert positions == sorted(positions)
    assert "tired of this" not in summary.text
    assert "frustrating" not in summary.text


@pytest.mark.parametrize("budget", [1, 3, 8, 17, 40, 64, 300])
async def test_extractive_stays_within_target_tokens(budget: int) -> None:
    items = [*CONVERSATION, message(7, "tool", json.dumps({"rows": list(range(300))}))]
    summary = await ExtractiveSummarizer().summarize(items, level=1, target_tokens=budget)
    assert count_text(summary.text, model="gpt-4o") <= budget
    assert summary.text  # even one token says something


async def test_extractive_level_two_merges_children_facts() -> None:
    child_a = SummaryInput(
        node_id=100,
        level=1,
        role=None,
        text="user: Asked about invoice INV-2041.\nassistant: Found a duplicate charge.",
        facts={
            "identifiers": ["INV-2041", "ch_only_in_facts"],
            "numbers": ["$1,249.50"],
            "names": ["Acme Corp"],
            "dates": ["March 3"],
            "decisions": ["Refund the duplicate."],
            "open_questions": [],
        },
        created_at=None,
        seq_start=0,
        seq_end=19,
    )
    child_b = SummaryInput(
        node_id=101,
        level=1,
        role=None,
        text="assistant: Deployed fix PR #482 on 2024-03-09.",
        # Stored facts of any shape are taken: here a bare string instead of a list.
        facts={"identifiers": ["#482"], "dates": ["2024-03-09"], "names": "Maria Lopez"},  # type: ignore[dict-item]
        created_at=None,
        seq_start=20,
        seq_end=33,
    )
    summary = await ExtractiveSummarizer().summarize([child_a, child_b], level=2, target_tokens=200)
    facts = summary.facts
    assert facts["identifiers"][:3] == ["INV-2041", "#482", "ch_only_in_facts"]  # round-robin
    assert "Maria Lopez" in facts["names"]
    assert facts["dates"][:2] == ["March 3", "2024-03-09"]
    assert facts["decisions"] == ["Refund the duplicate."]
    # Level ≥ 2 adds no speaker prefix; the children's own lines keep theirs.
    assert summary.text.splitlines()[0].startswith("user: Asked about invoice INV-2041.")
    assert "Deployed fix PR #482" in summary.text


async def test_facts_are_deduplicated_and_capped() -> None:
    text = " ".join(f"Ticket OPS-{i} and OPS-1 again." for i in range(200))
    facts = extract_facts([message(1, "user", text)])
    assert facts["identifiers"].count("OPS-1") == 1
    assert len(facts["identifiers"]) <= 60
    assert facts["identifiers"][:2] == ["OPS-0", "OPS-1"]


def test_fact_patterns() -> None:
    text = (
        "Meeting on 3 March 2024 at 10:30 UTC with Dr. Jane Smith from Initech; the deadline "
        "is next Friday. Budget $12.5k, 40% of Q3 FY24. Run `pytest -q` in ./tests/unit, see "
        "PR #482, ABC-17, sha e3b0c44298fc1c14 and 123e4567-e89b-12d3-a456-426614174000. "
        "Docs: https://docs.example.com/a/b?x=1. We agreed to use PostgreSQL 16.2 with "
        "pgvector v0.7.0; getUserById() in user_service.py is slow (p99 = 850 ms). TODO: ask "
        'Bob. {"order_id": "ORD-7731", "elapsed_ms": 412}'
    )
    facts = extract_facts([message(1, "user", text)])
    for identifier in (
        "pytest -q",
        "./tests/unit",
        "#482",
        "ABC-17",
        "e3b0c44298fc1c14",
        "123e4567-e89b-12d3-a456-426614174000",
        "https://docs.example.com/a/b?x=1",
        "v0.7.0",
        "user_service.py",
        "ORD-7731",
    ):
        assert identifier in facts["identifiers"]
    assert "elapsed_ms" not in facts["identifiers"]  # a JSON key is schema, not a fact
    assert {"$12.5k", "40%", "16.2", "850 ms", "412"} <= set(facts["numbers"])
    assert "2024" not in facts["numbers"]  # part of a date
    assert {"3 March 2024", "10:30 UTC", "next Friday", "Q3 FY24"} <= set(facts["dates"])
    assert {"Jane Smith", "Initech", "Bob"} <= set(facts["names"])
    assert "Dr" not in facts["names"]
    assert any(d.startswith("We agreed to use PostgreSQL") for d in facts["decisions"])
    assert facts["open_questions"] == ["TODO: ask Bob."]


def test_a_full_name_opening_a_sentence_keeps_its_first_word() -> None:
    text = (
        "Caroline Smith said the venue is booked. Yesterday Melanie Brown called. "
        "Ask Bob about the cake. Caroline agreed."
    )
    names = extract_facts([message(1, "user", text)])["names"]
    assert {"Caroline Smith", "Melanie Brown", "Bob"} <= set(names)
    # A common word that opens a sentence is no part of the name after it, and a lone capital
    # there says nothing.
    assert not {"Smith", "Yesterday Melanie Brown", "Ask Bob", "Caroline"} & set(names)


async def test_bad_arguments() -> None:
    summarizer = ExtractiveSummarizer()
    with pytest.raises(ValueError):
        await summarizer.summarize([], level=1, target_tokens=10)
    with pytest.raises(ValueError):
        await summarizer.summarize(CONVERSATION, level=0, target_tokens=10)
    with pytest.raises(ValueError):
        await summarizer.summarize(CONVERSATION, level=1, target_tokens=0)


def synthetic_messages(n: int) -> list[SummaryInput]:
    rnd = random.Random(7)
    people = ["Maria Lopez", "Ken Watanabe", "Priya Raman", "Acme Corp", "Globex"]

    def rid() -> str:
        return f"{rnd.choice(['INV', 'OPS', 'BUG'])}-{rnd.randint(100, 9999)}"

    def user() -> str:
        return rnd.choice(
            [
                f"Can you check why {rid()} keeps failing since Monday? {rnd.choice(people)} "
                f"says the error rate is around {rnd.randint(2, 40)}%.",
                f"Please update services/billing/settings.yaml so the timeout is "
                f"{rnd.randint(5, 120)} seconds instead.",
                "ok sounds good, go ahead",
                f"We decided to ship the fix on 2024-06-0{rnd.randint(1, 9)}; "
                f"{rnd.choice(people)} will review it. Does that work for you?",
                "Honestly I'm not sure what the best approach is here. What would you "
                "recommend, and why? I want something simple that the team can maintain.",
            ]
        )

    def assistant() -> str:
        parts = [
            "Sure, let me take a look at that.",
            f"The job `sync_invoices` times out after {rnd.randint(10, 90)} s because the "
            f"pool only has {rnd.randint(2, 16)} connections.",
            f"The failing commit is {rnd.getrandbits(40):010x}, merged by "
            f"{rnd.choice(people)} on April 2.",
            "There are a few ways to approach this, and each has trade-offs worth thinking "
            "about carefully before we commit.",
            f"I suggest raising `max_connections` to {rnd.randint(20, 64)} and adding a "
            "retry with backoff in retry_policy.py.",
            f"See https://docs.example.com/runbooks/{rnd.randint(1, 99)} for the runbook.",
            "Let me know if you want me to proceed with any of these options.",
        ]
        rnd.shuffle(parts)
        return " ".join(parts[: rnd.randint(3, 7)])

    def tool() -> str:
        return json.dumps({"status": "ok", "id": rid(), "rows": rnd.randint(0, 5000)})

    roles = ["user", "assistant", "tool", "assistant", "user", "assistant", "user", "assistant"]
    makers = {"user": user, "assistant": assistant, "tool": tool}
    return [message(i, roles[i % 8], makers[roles[i % 8]]()) for i in range(n)]


async def test_extractive_summarizes_every_chunk_with_its_identifiers() -> None:
    messages = synthetic_messages(2000)
    summarizer = ExtractiveSummarizer()
    summaries = [
        await summarizer.summarize(messages[i : i + 20], level=1, target_tokens=256)
        for i in range(0, len(messages), 20)
    ]
    # Its speed is measured by `bench.throughput` ("level-1 summaries"), not timed here.
    assert all(s.text and s.facts["identifiers"] for s in summaries)


# --- LLM ----------------------------------------------------------------------------------------

LLM_FACTS: dict[str, list[str]] = {
    "identifiers": ["INV-2041", "re_9f8e7d6c"],
    "numbers": ["$1,249.50 charged twice"],
    "names": ["Maria Lopez", "Acme Corp"],
    "dates": ["2024-03-08 (confirmation deadline)"],
    "decisions": ["Refund the duplicate charge."],
    "open_questions": ["Disable retries for non-idempotent calls?"],
}
NARRATIVE = "The user asked why INV-2041 was charged twice; a retry caused it and was refunded."


@pytest.fixture
async def client(upstream: UpstreamServer) -> AsyncIterator[Provider]:
    """The fake upstream with a key and no retries: each scripted failure is seen as it is."""
    upstream.reset()
    provider = Provider(base_url=upstream.url, api_key="sk-test", max_retries=0)
    yield provider
    await provider.aclose()


@pytest.fixture
async def keyless(upstream: UpstreamServer) -> AsyncIterator[Provider]:
    upstream.reset()
    provider = Provider(base_url=upstream.url, api_key=None, max_retries=0)
    yield provider
    await provider.aclose()


def llm(upstream: UpstreamServer, client: Provider, **kwargs: Any) -> LLMSummarizer:
    return LLMSummarizer(client, model="summary-model", **kwargs)


async def test_llm_request_and_parsed_summary(upstream: UpstreamServer, client: Provider) -> None:
    upstream.script({"reply": json.dumps({"narrative": NARRATIVE, **LLM_FACTS})})
    summary = await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=120)

    (request,) = upstream.requests("/v1/chat/completions")
    body = request["body"]
    assert body["model"] == "summary-model"
    assert body["response_format"] == {"type": "json_object"}
    assert body["temperature"] == 0
    assert body["stream"] is False
    assert request["headers"]["authorization"] == "Bearer sk-test"
    system, user = body["messages"]
    assert system["role"] == "system" and "JSON" in system["content"]
    assert "120 tokens" in system["content"]
    for key in FACT_KEYS:
        assert f'"{key}"' in system["content"]
    prompt = user["content"]
    assert "[#1] (2024-03-04T09:31+00:00) user: Hi! Can you find out why invoice INV-2041" in prompt
    assert "[#6] (2024-03-04T09:36+00:00) assistant: Done: refund re_9f8e7d6c issued." in prompt
    assert prompt.index("[#1]") < prompt.index("[#6]")

    assert summary == Summary(
        text=NARRATIVE,
        facts=summary.facts,
        method="llm",
        model="summary-model",
    )
    # The model's facts come first, as given ...
    for key, values in LLM_FACTS.items():
        assert summary.facts[key][: len(values)] == values
    # ... then the exact identifiers, numbers and dates it left out, found in the input.
    assert "retry_policy.py" in summary.facts["identifiers"]
    assert "billing@acme.example" in summary.facts["identifiers"]
    assert "30 s" in summary.facts["numbers"]
    assert "Friday" in summary.facts["dates"]
    assert summary.facts["names"] == LLM_FACTS["names"]  # fuzzy kinds are left to the model


async def test_llm_a_model_that_takes_no_temperature_is_asked_without_one(
    upstream: UpstreamServer, client: Provider
) -> None:
    """Reasoning models (o-series, gpt-5) refuse any temperature but their default: the
    request is sent again without one, and so is every later one; the refusal never reaches
    the build (a summary model such as gpt-5-mini made no summary at all)."""
    refusal = {
        "error": {
            "message": "Unsupported value: 'temperature' does not support 0 with this model. "
            "Only the default (1) value is supported.",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "unsupported_value",
        }
    }
    reply = json.dumps({"narrative": NARRATIVE, **LLM_FACTS})
    upstream.script({"status": 400, "body": refusal}, {"reply": reply}, {"reply": reply})
    summarizer = llm(upstream, client)
    for _ in range(2):
        summary = await summarizer.summarize(CONVERSATION, level=1, target_tokens=120)
        assert (summary.text, summary.method) == (NARRATIVE, "llm")
    sent = [request["body"] for request in upstream.requests("/v1/chat/completions")]
    assert [body.get("temperature") for body in sent] == [0, None, None]

    # Another refusal is the summary's failure, as before.
    upstream.script({"status": 400})
    with pytest.raises(ProviderError, match="HTTP 400"):
        await summarizer.summarize(CONVERSATION, level=1, target_tokens=120)


async def test_llm_reply_is_bounded_by_the_summary_budget(
    upstream: UpstreamServer, client: Provider
) -> None:
    """A summary request carries `max_tokens` from the narrative's budget (MEMSTRATA_SUMMARY_
    TOKENS): without it, a model caught in JSON mode's whitespace runaway wrote, and billed, up
    to the end of its context. A model that takes only `max_completion_tokens` (OpenAI's
    reasoning and newer models refuse `max_tokens`) is asked again with that, with room for its
    reasoning, and so is every later request."""
    refusal = {
        "error": {
            "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
            "Use 'max_completion_tokens' instead.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "unsupported_parameter",
        }
    }
    reply = json.dumps({"narrative": NARRATIVE, **LLM_FACTS})
    upstream.script({"reply": reply}, {"status": 400, "body": refusal}, {"reply": reply})
    upstream.script({"reply": reply})
    summarizer = llm(upstream, client)
    for _ in range(3):
        summary = await summarizer.summarize(CONVERSATION, level=1, target_tokens=120)
        assert (summary.text, summary.method) == (NARRATIVE, "llm")
    sent = [request["body"] for request in upstream.requests("/v1/chat/completions")]
    limits = [(body.get("max_tokens"), body.get("max_completion_tokens")) for body in sent]
    assert limits == [(1504, None), (1504, None), (None, 9696), (None, 9696)]


async def test_llm_level_two_prompt_carries_children_and_their_facts(
    upstream: UpstreamServer, client: Provider
) -> None:
    upstream.script({"reply": json.dumps({"narrative": "Two parts merged."})})
    children = [
        SummaryInput(10, 1, None, "Refund for INV-2041.", LLM_FACTS, T0, 1, 20),
        SummaryInput(11, 1, None, "Deployed PR #482.", {"identifiers": ["#482"]}, None, 21, 40),
    ]
    summary = await llm(upstream, client, augment_facts=False).summarize(
        children, level=2, target_tokens=200
    )
    prompt = upstream.requests()[0]["body"]["messages"][1]["content"]
    assert prompt.startswith("Merge these 2 summaries")
    assert "[#10] summary of messages 1-20 (2024-03-04T09:30+00:00): Refund for INV-2041." in prompt
    assert "  identifiers: INV-2041; re_9f8e7d6c" in prompt
    assert "[#11] summary of messages 21-40: Deployed PR #482.\n  identifiers: #482" in prompt
    assert summary.text == "Two parts merged."
    assert summary.facts == {key: [] for key in FACT_KEYS}


@pytest.mark.parametrize(
    "reply",
    [
        "```json\n{body}\n```",
        "Here is the summary you asked for:\n\n```\n{body}\n```\nLet me know!",
        "Sure! {body} Hope this helps.",
        "Note {{not json}} first. {body}",
    ],
)
async def test_llm_parses_wrapped_json(
    upstream: UpstreamServer, client: Provider, reply: str
) -> None:
    body = json.dumps({"narrative": NARRATIVE, **LLM_FACTS}, indent=2)
    upstream.script({"reply": reply.replace("{body}", body)})
    summary = await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert summary.text == NARRATIVE
    assert summary.facts["decisions"] == LLM_FACTS["decisions"]


async def test_llm_reply_that_is_not_json_becomes_the_narrative(
    upstream: UpstreamServer, client: Provider
) -> None:
    upstream.script({"reply": "  The user asked about INV-2041; it was refunded.  "})
    summary = await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert summary.text == "The user asked about INV-2041; it was refunded."
    assert summary.method == "llm"
    assert summary.facts == extract_facts(CONVERSATION)


async def test_llm_fenced_prose_becomes_the_narrative(
    upstream: UpstreamServer, client: Provider
) -> None:
    upstream.script({"reply": "```\nINV-2041 was refunded.\n```"})
    summary = await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert summary.text == "INV-2041 was refunded."


async def test_llm_tolerates_odd_fact_shapes(upstream: UpstreamServer, client: Provider) -> None:
    reply = {
        "summary": ["Odd", "shapes."],
        "identifiers": "INV-2041",
        "numbers": [3, 2.5, True, None],
        "dates": [{"date": "2024-03-08", "what": "deadline"}],
        "names": None,
    }
    upstream.script({"reply": json.dumps(reply)})
    summary = await llm(upstream, client, augment_facts=False).summarize(
        CONVERSATION, level=1, target_tokens=100
    )
    assert summary.text == "Odd shapes."
    assert summary.facts["identifiers"] == ["INV-2041"]
    assert summary.facts["numbers"] == ["3", "2.5"]
    assert summary.facts["dates"] == ["2024-03-08 — deadline"]
    assert list(summary.facts) == list(FACT_KEYS)


@pytest.mark.parametrize(
    "behaviour",
    [
        {"status": 500},
        {"status": 429},
        {"body": {"choices": []}},
        {"body": "not json at all"},
        {"reply": ""},
        {"reply": json.dumps({"identifiers": ["x"]})},  # JSON without a narrative
        {"cut_after": 0},  # the connection closes without an answer
        # Nested deeper than Python's parser recurses (a model caught in a loop of brackets),
        # in the reply or in the body around it.
        {"reply": '{"narrative": "x", "numbers": ' + "[" * 5000 + "]" * 5000 + "}"},
        {"body": '{"choices": ' + "[" * 5000 + "]" * 5000 + "}"},
        # Cut at the length limit: no summary, though an object inside it is whole.
        {"reply": '{"narrative": "INV-2041 was refun', "finish_reason": "length"},
        {
            "reply": '{"narrative": "INV-2041 was refunded.", "decisions": '
            '[{"text": "Refund the duplicate.", "by": "Maria"}, {"te',
            "finish_reason": "length",
        },
        # Stopped by a content filter part way: what came is no summary.
        {"reply": '{"narrative": "INV-2041 was refun', "finish_reason": "content_filter"},
        # JSON that does not parse (a trailing comma) is a malformed reply, not prose.
        {"reply": '{"narrative": "INV-2041 was refunded.", "identifiers": ["INV-2041",],}'},
    ],
)
async def test_llm_failures_raise_provider_error(
    upstream: UpstreamServer, client: Provider, behaviour: dict[str, Any]
) -> None:
    upstream.script(behaviour)
    with pytest.raises(ProviderError) as caught:
        await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert "INV-2041" not in str(caught.value)  # no conversation text in errors


async def test_llm_reply_whole_before_its_length_limit_is_kept(
    upstream: UpstreamServer, client: Provider
) -> None:
    # JSON mode's known failure: the object, then whitespace until the limit.
    body = json.dumps({"narrative": NARRATIVE, **LLM_FACTS})
    upstream.script({"reply": body + "\n" * 50, "finish_reason": "length"})
    summary = await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert summary.text == NARRATIVE


async def test_llm_http_error_keeps_its_cause(upstream: UpstreamServer, client: Provider) -> None:
    upstream.script({"status": 500})
    with pytest.raises(ProviderError, match="HTTP 500") as caught:
        await llm(upstream, client).summarize(CONVERSATION, level=1, target_tokens=100)
    assert isinstance(caught.value.__cause__, openai.APIStatusError)


async def test_llm_timeout_and_unreachable(upstream: UpstreamServer, client: Provider) -> None:
    upstream.script({"delay": 1.0})
    with pytest.raises(ProviderError, match="timed out") as caught:
        await llm(upstream, client, timeout=0.2).summarize(CONVERSATION, level=1, target_tokens=9)
    assert isinstance(caught.value.__cause__, openai.APITimeoutError)

    nowhere = Provider(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key=None, max_retries=0)
    with pytest.raises(ProviderError, match="unreachable") as caught:
        await LLMSummarizer(nowhere, model="m").summarize(CONVERSATION, level=1, target_tokens=9)
    assert isinstance(caught.value.__cause__, openai.APIConnectionError)
    await nowhere.aclose()
    await asyncio.sleep(1.0)  # let the delayed answer finish before the next test resets


# --- auto ---------------------------------------------------------------------------------------


async def test_auto_falls_back_to_extractive_on_a_failing_upstream(
    upstream: UpstreamServer, keyless: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.script({"status": 500})
    auto = make_summarizer("auto", provider=keyless, model="summary-model")
    with caplog.at_level(logging.WARNING, logger="memory.build.summarize"):
        summary = await auto.summarize(CONVERSATION, level=1, target_tokens=60)
    assert summary.method == "extractive"
    assert summary.model is None
    assert "INV-2041" in summary.text
    assert len(upstream.requests("/v1/chat/completions")) == 1
    (record,) = caplog.records
    assert "HTTP 500" in record.getMessage()
    logged = record.getMessage() + json.dumps(record.args, default=str)
    for secret in ("INV-2041", "Acme", "refund"):
        assert secret not in logged


async def test_auto_reports_a_failure_once_for_concurrent_summaries(
    upstream: UpstreamServer, client: Provider, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.set_default({"status": 502, "delay": 0.2})
    try:
        auto = FallbackSummarizer(llm(upstream, client), ExtractiveSummarizer(), cooldown=60)
        with caplog.at_level(logging.WARNING, logger="memory.build.summarize"):
            summaries = await asyncio.gather(
                *(auto.summarize(CONVERSATION, level=1, target_tokens=40) for _ in range(4))
            )
    finally:
        upstream.set_default({})
    assert [s.method for s in summaries] == ["extractive"] * 4
    assert len(upstream.requests()) == 4
    assert len(caplog.records) == 1


async def test_auto_uses_the_llm_when_it_works(upstream: UpstreamServer, keyless: Provider) -> None:
    upstream.script({"reply": json.dumps({"narrative": NARRATIVE, **LLM_FACTS})})
    auto = make_summarizer("auto", provider=keyless, model="summary-model")
    summary = await auto.summarize(CONVERSATION, level=1, target_tokens=60)
    assert (summary.method, summary.model, summary.text) == ("llm", "summary-model", NARRATIVE)
    assert "authorization" not in upstream.requests()[0]["headers"]


async def test_auto_skips_a_failed_llm_for_the_cooldown(
    upstream: UpstreamServer, client: Provider
) -> None:
    good = {"reply": json.dumps({"narrative": NARRATIVE})}
    upstream.script({"status": 503}, good, good)  # the two good answers must stay unused
    auto = FallbackSummarizer(llm(upstream, client), ExtractiveSummarizer(), cooldown=60)
    methods = [
        (await auto.summarize(CONVERSATION, level=1, target_tokens=60)).method for _ in range(3)
    ]
    assert methods == ["extractive"] * 3
    assert len(upstream.requests()) == 1  # the next two did not wait on a broken upstream
    assert len(upstream.pending()) == 2

    upstream.reset()
    retrying = FallbackSummarizer(llm(upstream, client), ExtractiveSummarizer(), cooldown=0)
    upstream.script({"status": 503}, good)
    methods = [
        (await retrying.summarize(CONVERSATION, level=1, target_tokens=60)).method for _ in range(2)
    ]
    assert methods == ["extractive", "llm"]


async def test_make_summarizer() -> None:
    assert isinstance(
        make_summarizer("extractive", provider=None, model=None), ExtractiveSummarizer
    )
    provider = Provider(base_url="http://x/v1", api_key=None)
    assert isinstance(make_summarizer("llm", provider=provider, model="m"), LLMSummarizer)
    assert isinstance(make_summarizer("auto", provider=provider, model="m"), FallbackSummarizer)
    with pytest.raises(ValueError):
        make_summarizer("llm", provider=provider, model=None)
    with pytest.raises(ValueError):
        make_summarizer("auto", provider=None, model="m")
    with pytest.raises(ValueError):
        make_summarizer("magic", provider=provider, model="m")  # type: ignore[arg-type]
    await provider.aclose()


async def test_a_short_burst_of_429s_changes_no_summary(upstream: UpstreamServer) -> None:
    """Background calls retry as the openai SDK does, waiting what `Retry-After` asks: two
    429s in a row are absorbed, and the summary is still the LLM's."""
    upstream.reset()
    busy = {"status": 429, "headers": {"Retry-After": "0.1"}}
    upstream.script(busy, busy, {"reply": json.dumps({"narrative": NARRATIVE})})
    provider = Provider(base_url=upstream.url, api_key=None, max_retries=2)
    auto = make_summarizer("auto", provider=provider, model="summary-model")
    summary = await auto.summarize(CONVERSATION, level=1, target_tokens=60)
    await provider.aclose()
    assert (summary.method, summary.text) == ("llm", NARRATIVE)
    assert len(upstream.requests("/v1/chat/completions")) == 3
