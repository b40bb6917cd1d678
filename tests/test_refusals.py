"""End to end: a turn the upstream refuses as invalid leaves the conversation's current branch
(`memory.write.refusals`), through the real `openai` SDK → a `memstrata serve` process → the
fake upstream process.

A client that names its conversation sends only its new messages. Were the refused message
kept on the branch, every later prompt would repeat it and a real upstream would refuse each
one: the conversation would be stuck. It stays stored, off the branch; a fault that is no
refusal (429, 5xx) keeps the question for the next turn, as before.
"""

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer

pytestmark = pytest.mark.usefixtures("fresh_upstream")

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
INVALID_IMAGE = {
    "error": {
        "message": "Error while downloading https://example.invalid/cat.png.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_image_url",
    }
}
WORDS = "the harbour ferry leaves at dawn and the market opens at nine " * 4


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url, api_key="sk-r", max_retries=0, timeout=15) as sdk:
        yield sdk


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.root_url, timeout=15) as raw:
        yield raw


def image_message() -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": f"What is in this picture? {uuid.uuid4().hex[:6]}"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
        ],
    }


def stored(http: httpx.Client, conversation: str) -> list[tuple[Any, bool]]:
    """Every stored message's content, and whether it is on the current branch."""
    answer = http.get(f"/admin/conversations/{conversation}/messages")
    assert answer.status_code == 200, answer.text
    return [(m["content"], m["superseded_at"] is None) for m in answer.json()["messages"]]


# Earlier turns before the refused one: none (the conversation's first turn), a few, and enough
# to be past the budget, where the prompt comes from the working context.
@pytest.mark.parametrize("earlier", [0, 2, 12], ids=["first turn", "later turn", "past budget"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_turn_the_upstream_refuses_leaves_the_branch_and_the_next_prompt(
    client: openai.OpenAI,
    http: httpx.Client,
    upstream: UpstreamServer,
    earlier: int,
    stream: bool,
) -> None:
    conversation = f"refused-{uuid.uuid4().hex}"
    headers = {HEADER: conversation, "X-Memstrata-Budget": "1500"}
    said = [f"Turn {i}: {WORDS}" for i in range(earlier)]
    for text in said:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": text}], extra_headers=headers
        )
    refused = image_message()
    upstream.script({"status": 400, "body": INVALID_IMAGE})
    with pytest.raises(openai.BadRequestError) as failed:
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[refused],  # type: ignore[list-item]
            extra_headers=headers,
            stream=stream,
        )
    assert failed.value.body == INVALID_IMAGE["error"]
    assert failed.value.response.headers[HEADER] == conversation

    upstream.reset()
    after = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Never mind the picture."}],
        extra_headers=headers,
    )
    if earlier == 12:  # the prompt came from memory, not from the whole history
        full = int(after.headers["X-Memstrata-Full-Tokens"])
        assert int(after.headers["X-Memstrata-Context-Tokens"]) < full
    [sent] = upstream.requests(CHAT)
    prompt = sent["body"]["messages"]
    assert refused["content"] not in [message.get("content") for message in prompt]
    assert prompt[-1] == {"role": "user", "content": "Never mind the picture."}
    if earlier == 0:
        assert prompt == [{"role": "user", "content": "Never mind the picture."}]
    # Nothing is lost: the refused message is kept, off the branch; the rest is the branch.
    kept = stored(http, conversation)
    assert (refused["content"], False) in kept
    assert [content for content, current in kept if current] == [
        *(part for text in said for part in (text, f"echo: {text}")),
        "Never mind the picture.",
        "echo: Never mind the picture.",
    ]


@pytest.mark.parametrize("status", [429, 500])
def test_a_fault_that_is_no_refusal_keeps_the_question_for_the_next_turn(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, status: int
) -> None:
    conversation = f"fault-{uuid.uuid4().hex}"
    headers = {HEADER: conversation}
    question = f"Where does the ferry leave from? {uuid.uuid4().hex[:6]}"
    upstream.script({"status": status})
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": question}],
            extra_headers=headers,
        )
    upstream.reset()
    client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Hello?"}],
        extra_headers=headers,
    )
    [sent] = upstream.requests(CHAT)
    assert [m["content"] for m in sent["body"]["messages"]] == [question, "Hello?"]
    assert stored(http, conversation)[0] == (question, True)


def test_a_refused_response_request_leaves_its_conversation(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    """The Responses API's `conversation` (openai-agents' `conversation_id`) likewise sends only
    each run's new input."""
    first = client.responses.with_raw_response.create(model="gpt-4o-mini", input="Hello there.")
    conversation = first.headers[HEADER]
    upstream.script({"status": 400, "body": INVALID_IMAGE})
    refused = f"Describe https://example.invalid/cat.png {uuid.uuid4().hex[:6]}"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="gpt-4o-mini", input=refused, conversation=conversation)
    upstream.reset()
    client.responses.create(model="gpt-4o-mini", input="Thanks anyway.", conversation=conversation)
    [sent] = [r for r in upstream.requests() if r["path"] != "/v1/models"]
    assert refused not in str(sent["body"])
    assert "Hello there." in str(sent["body"])
    assert (refused, False) in stored(http, conversation)
