"""Provider caching end to end, through real `memstrata serve` processes and the fake upstream
(which reports as cached the leading messages an earlier prompt began with, byte for byte):

* two serve processes alternating on one conversation build the same prefix: each prompt
  repeats the previous one, byte for byte, except on the turns that compacted;
* the conversation's statistics and `/metrics` show memory reuse, compactions and what the
  upstream reported as cached;
* a conversation-scoped `prompt_cache_key` goes upstream when the client sent none, never in
  place of the client's own, on chat completions and the Responses API alike.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from devkit import synthetic
from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.settings import Settings

CHAT = "/v1/chat/completions"
MODEL = "gpt-4o"
# Notes kept in the context, of the share they were measured with when kept: at the default
# share (the note fills what the context leaves) a kept note brings the next compaction at once.
SETTINGS: dict[str, Any] = {
    "workers": 0,
    "memory_tools": "never",
    "keep_notes": "on",
    "note_share": 0.2,
}


@pytest.fixture(scope="module")
def gateways(
    database_url: str, upstream: UpstreamServer
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    with (
        GatewayProcess(
            database_url=database_url,
            upstream_url=upstream.url,
            name="gateway-a",
            prompt_cache_key="on",
            **SETTINGS,
        ) as first,
        GatewayProcess(
            database_url=database_url,
            upstream_url=upstream.url,
            name="gateway-b",
            prompt_cache_key="on",
            **SETTINGS,
        ) as second,
    ):
        yield first, second


def turns(prompt: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The messages after the system ones (stable memory): the verbatim turns and the new."""
    start = 0
    while start < len(prompt) and prompt[start]["role"] == "system":
        start += 1
    return [(m["role"], m.get("content")) for m in prompt[start:]]


def raw(messages: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(m, ensure_ascii=False, separators=(",", ":")) for m in messages]


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def test_two_serve_processes_alternating_build_the_same_prefix(
    gateways: tuple[GatewayProcess, GatewayProcess], upstream: UpstreamServer
) -> None:
    conversation = f"two-{uuid.uuid4().hex}"
    headers = {"X-Memstrata-Conversation": conversation, "X-Memstrata-Budget": "3000"}
    clients = [httpx.Client(base_url=g.root_url, timeout=60) for g in gateways]
    try:
        imported = clients[0].post(
            f"/admin/conversations/{conversation}/messages",
            json={"messages": synthetic.messages(300, seed=14), "model": MODEL},
        )
        assert imported.status_code == 201, imported.text
        upstream.reset()
        before = [metric(c.get("/metrics").text, "memstrata_compactions_total") for c in clients]
        asks = [m for m in synthetic.messages(200, seed=15) if m["role"] == "user"][:24]
        previous: list[dict[str, Any]] | None = None
        compactions = 0
        compared = 0
        for number, ask in enumerate(asks):
            http = clients[number % 2]
            response = http.post(CHAT, json={"model": MODEL, "messages": [ask]}, headers=headers)
            assert response.status_code == 200, response.text
            sent = upstream.requests(CHAT)[-1]["body"]
            assert sent["prompt_cache_key"].startswith("memstrata-")
            prompt = sent["messages"]
            stats = http.get(f"/admin/conversations/{conversation}").json()
            if previous is not None:
                if stats["compactions"] == compactions:
                    # Whichever process served it, the prompt repeats the previous one whole.
                    assert raw(prompt[: len(previous)]) == raw(previous)
                    compared += 1
                else:
                    assert prompt[0] == previous[0]  # stable memory before the compaction
            compactions = stats["compactions"]
            previous = prompt
        assert compactions >= 1 and compared >= 12
        keys = {request["body"]["prompt_cache_key"] for request in upstream.requests(CHAT)}
        assert len(keys) == 1  # one key for the conversation, from both processes
        stats = clients[0].get(f"/admin/conversations/{conversation}").json()
        assert stats["memory_reuse"] > 0.5
        assert stats["tokens_cached"] > 0
        assert stats["working_context"]["compactions"] == compactions
        # The dry run: the next prompt for a question, its parts labelled, and what it repeats.
        dry = clients[1].post(
            f"/admin/conversations/{conversation}/context",
            json={"query": "What did we decide about the budget?", "budget": 3000},
        )
        assert dry.status_code == 200, dry.text
        context = dry.json()
        labels = [part["label"] for part in context["parts"]]
        assert labels[0] == "stable" and labels[-1] == "new" and "verbatim" in labels
        assert sum(part["messages"] for part in context["parts"]) == len(context["messages"])
        assert context["working_context"] and not context["compacted"]
        assert 0.5 < context["reuse"] <= 1 and context["reused_tokens"] > 0
        after = [metric(c.get("/metrics").text, "memstrata_compactions_total") for c in clients]
        assert sum(after) - sum(before) == compactions
        assert all(
            metric(c.get("/metrics").text, "memstrata_upstream_cached_tokens_total") > 0
            for c in clients
        )
    finally:
        for client in clients:
            client.close()


def test_an_edit_cuts_the_context_back_without_duplicates_a_regenerate_keeps_it(
    gateways: tuple[GatewayProcess, GatewayProcess], upstream: UpstreamServer
) -> None:
    """A client that resends its whole history edits a message the working context holds
    verbatim, then regenerates the answer: the edit cuts the context back to the message before
    it, so the prompt repeats the last one up to there (it was rebuilt whole), and its verbatim
    turns are the current branch's newest messages, each once, none of the abandoned ones; the
    regenerate branches after what the context holds, which keeps its prefix."""
    conversation = f"edit-{uuid.uuid4().hex}"
    headers = {"X-Memstrata-Conversation": conversation, "X-Memstrata-Budget": "3000"}
    history: list[dict[str, Any]] = synthetic.messages(300, seed=16)
    with httpx.Client(base_url=gateways[0].root_url, timeout=60) as http:

        def ask(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            response = http.post(
                CHAT, json={"model": MODEL, "messages": messages, **extra}, headers=headers
            )
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            return {"role": "assistant", "content": message["content"]}

        def version() -> int:
            stats = http.get(f"/admin/conversations/{conversation}").json()
            return int(stats["working_context"]["version"])

        imported = http.post(
            f"/admin/conversations/{conversation}/messages",
            json={"messages": history, "model": MODEL},
        )
        assert imported.status_code == 201, imported.text
        for number in range(4):
            history.append({"role": "user", "content": f"question {number} {uuid.uuid4().hex}"})
            history.append(ask(history))
        before = version()
        last = upstream.requests(CHAT)[-1]["body"]["messages"]
        # Edit the second to last question: a branch inside the verbatim turns.
        edited = [*history[:-3], {"role": "user", "content": f"edited {uuid.uuid4().hex}"}]
        edited.append(ask(edited))
        prompt = upstream.requests(CHAT)[-1]["body"]["messages"]
        assert version() == before + 1
        kept = 1 + next(i for i, m in enumerate(last) if m.get("content") == history[-4]["content"])
        assert raw(prompt[:kept]) == raw(last[:kept])
        assert history[-3]["content"] not in json.dumps(prompt)
        assert turns(prompt) == turns(edited[:-1])[-len(turns(prompt)) :]
        # Regenerate the answer just given (the same history asked again): it branches after
        # what the context holds, so the prefix stays; the abandoned answer is not sent.
        previous = prompt
        ask(edited[:-1], temperature=0.9)
        prompt = upstream.requests(CHAT)[-1]["body"]["messages"]
        assert version() == before + 1
        assert raw(prompt) == raw(previous)


def test_context_sent_with_each_question_past_the_budget_keeps_the_prefix(
    gateways: tuple[GatewayProcess, GatewayProcess], upstream: UpstreamServer
) -> None:
    """A client that resends its whole history, with no conversation id, and sends retrieved
    context as a message right before its newest question only, past the budget: each turn is
    answered in the one conversation (the history was taken for a new conversation, and
    refused as too large for the budget), and its prompt repeats the last one up to the
    previous question, which the turn stores again as the client now sends it."""
    system = {"role": "system", "content": f"Answer from the context. {uuid.uuid4().hex}"}
    history: list[dict[str, Any]] = [system, *synthetic.messages(300, seed=17)]
    conversation = f"context-{uuid.uuid4().hex}"
    with httpx.Client(base_url=gateways[0].root_url, timeout=60) as http:
        imported = http.post(
            f"/admin/conversations/{conversation}/messages",
            json={"messages": history, "model": MODEL},
        )
        assert imported.status_code == 201, imported.text
        last: list[dict[str, Any]] | None = None
        for number in range(4):
            question = {"role": "user", "content": f"question {number} {uuid.uuid4().hex}"}
            sent = [*history, {"role": "system", "content": f"doc {number}"}, question]
            response = http.post(
                CHAT,
                json={"model": MODEL, "messages": sent},
                headers={"X-Memstrata-Budget": "3000"},
            )
            assert response.status_code == 200, response.text
            assert response.headers["X-Memstrata-Conversation"] == conversation
            prompt = upstream.requests(CHAT)[-1]["body"]["messages"]
            if last is not None:
                # Up to the answer before the previous question (then came its context).
                before = history[-3]["content"]
                kept = 1 + next(i for i, m in enumerate(last) if m.get("content") == before)
                assert raw(prompt[:kept]) == raw(last[:kept])
            last = prompt
            answer = response.json()["choices"][0]["message"]["content"]
            history += [question, {"role": "assistant", "content": answer}]


def test_a_cache_key_by_default_only_for_openais_own_api() -> None:
    assert Settings(_env_file=None).sends_cache_key
    local = Settings(_env_file=None, upstream_base_url="http://localhost:8000/v1")
    assert not local.sends_cache_key
    assert Settings(
        _env_file=None, upstream_base_url="http://localhost:8000/v1", prompt_cache_key="on"
    ).sends_cache_key
    assert not Settings(_env_file=None, prompt_cache_key="off").sends_cache_key


def test_the_marks_must_be_in_order() -> None:
    with pytest.raises(ValidationError, match="LOW_WATER must be below"):
        Settings(_env_file=None, context_low_water=0.9, context_high_water=0.8)


def test_the_clients_own_cache_key_is_kept(
    gateways: tuple[GatewayProcess, GatewayProcess], upstream: UpstreamServer
) -> None:
    upstream.reset()
    with httpx.Client(base_url=gateways[0].root_url, timeout=30) as http:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}],
            "prompt_cache_key": "mine",
        }
        assert http.post(CHAT, json=body).status_code == 200
    [sent] = upstream.requests(CHAT)
    assert sent["body"]["prompt_cache_key"] == "mine"


def test_responses_carry_the_conversations_cache_key_and_keep_the_clients(
    gateways: tuple[GatewayProcess, GatewayProcess], upstream: UpstreamServer
) -> None:
    """A response request goes upstream with its conversation's key, the one its chat turns
    carry, from either process; a client's own key is sent in its place."""
    upstream.reset()
    conversation = f"responses-{uuid.uuid4().hex}"
    headers = {"X-Memstrata-Conversation": conversation}
    clients = [httpx.Client(base_url=g.root_url, timeout=30) for g in gateways]
    try:
        for number in range(3):
            body = {"model": MODEL, "input": f"question {number} {uuid.uuid4().hex}"}
            answer = clients[number % 2].post("/v1/responses", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "and in chat?"}]}
        assert clients[0].post(CHAT, json=chat, headers=headers).status_code == 200
        mine = {"model": MODEL, "input": "my own key", "prompt_cache_key": "mine"}
        assert clients[1].post("/v1/responses", json=mine, headers=headers).status_code == 200
    finally:
        for client in clients:
            client.close()
    keys = [request["body"]["prompt_cache_key"] for request in upstream.requests("/v1/responses")]
    [chat_key] = [request["body"]["prompt_cache_key"] for request in upstream.requests(CHAT)]
    assert keys == [chat_key] * 3 + ["mine"] and chat_key.startswith("memstrata-")


def test_compactions_of_response_turns_are_counted_in_metrics(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """Turns through the Responses API that compact the working context count in `/metrics`
    as the conversation's statistics count them."""
    conversation = f"responses-compact-{uuid.uuid4().hex}"
    headers = {"X-Memstrata-Conversation": conversation, "X-Memstrata-Budget": "3000"}
    with httpx.Client(base_url=gateways[0].root_url, timeout=60) as http:
        imported = http.post(
            f"/admin/conversations/{conversation}/messages",
            json={"messages": synthetic.messages(300, seed=17), "model": MODEL},
        )
        assert imported.status_code == 201, imported.text
        before = metric(http.get("/metrics").text, "memstrata_compactions_total")
        asks = [m for m in synthetic.messages(200, seed=18) if m["role"] == "user"][:16]
        for ask in asks:
            body = {"model": MODEL, "input": ask["content"]}
            answered = http.post("/v1/responses", json=body, headers=headers)
            assert answered.status_code == 200, answered.text
        compactions = http.get(f"/admin/conversations/{conversation}").json()["compactions"]
        assert compactions >= 1
        after = metric(http.get("/metrics").text, "memstrata_compactions_total")
    assert after - before == compactions
