"""End to end: a client that resends only its latest turns (`memory.write.windows`), through a
`memstrata serve` process and the fake upstream process: raw HTTP for each way of naming the
conversation, and langchain-openai's `trim_messages` as a real client trims.

Each window must continue the one conversation with its new messages only: every message
stored once, on one branch, and the prompt sent upstream holding the turns the client no
longer sends (the conversation fits the budget, so it goes whole, from memory).

In-process (the app, and the background build run beside it): a window's edit sent while the
build writes the messages that edit drops is answered, not failed by a deadlock.
"""

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.utils import trim_messages
from langchain_openai import ChatOpenAI
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.build import indexing, tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer
from memory.schema import conversations, nodes
from memory.write import branches
from tests.inprocess import App

pytestmark = pytest.mark.usefixtures("fresh_upstream")

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
TURNS = 12
WORDS = "tulips go in before the first frost and the soil must drain well"


def branch(http: httpx.Client, conversation: str) -> tuple[list[Any], int]:
    """The contents of the conversation's current branch, and how many messages it stores."""
    answer = http.get(f"/admin/conversations/{conversation}/messages", params={"limit": 200})
    assert answer.status_code == 200, answer.text
    messages = answer.json()["messages"]
    return [m["content"] for m in messages if m["superseded_at"] is None], len(messages)


def reply_of(answer: httpx.Response) -> str:
    content: str = answer.json()["choices"][0]["message"]["content"]
    return content


# The window holds the last three messages one turn, the last four the next: it starts on a
# user message, then on an assistant message.
@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("budget", [8000, 700], ids=["fits", "past-budget"])
def test_a_window_of_the_last_messages_continues_its_conversation_storing_each_once(
    http: httpx.Client, upstream: UpstreamServer, named: bool, system: bool, budget: int
) -> None:
    tag = uuid.uuid4().hex[:8]
    opening = [{"role": "system", "content": f"You are terse. [{tag}]"}] if system else []
    headers = {"X-Memstrata-Budget": str(budget)}
    if named:
        headers[HEADER] = f"window-{tag}"
    said: list[dict[str, Any]] = []
    named_as = set()
    for turn in range(TURNS):
        said.append(
            {"role": "user", "content": f"Question {turn} about the garden [{tag}] {WORDS}"}
        )
        window = [*opening, *said[-(3 + turn % 2) :]]
        answer = http.post(CHAT, json={"model": "m", "messages": window}, headers=headers)
        assert answer.status_code == 200, answer.text
        named_as.add(answer.headers[HEADER])
        said.append({"role": "assistant", "content": reply_of(answer)})
    assert len(named_as) == 1
    [conversation] = named_as
    current, stored = branch(http, conversation)
    assert current == [m["content"] for m in [*opening, *said]]
    assert stored == len(opening) + 2 * TURNS
    prompt = [m["content"] for m in upstream.requests(CHAT)[-1]["body"]["messages"]]
    if budget == 8000:  # the conversation fits: sent as the client sent it
        assert prompt == [m["content"] for m in window]
    else:  # past the budget: from memory, which holds turns the window no longer does
        sent = [m["content"] for m in window]
        # Stable memory, consolidated ("[Memory of this conversation: ...") or appended by a
        # compaction ("[Memory: messages 0-14 of this conversation ..."), as the turn's token
        # counts fall.
        assert any(m.startswith("[Memory") for m in prompt), prompt
        assert prompt[-1] == sent[-1]

    # The same window again (an SDK's retry) is a retry of the same conversation: nothing
    # stored, no conversation started.
    again = http.post(CHAT, json={"model": "m", "messages": window}, headers=headers)
    assert again.status_code == 200, again.text
    assert again.headers[HEADER] == conversation
    assert branch(http, conversation)[1] == stored


def test_a_named_conversation_resent_its_last_reply_and_a_new_question(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    """The smallest window: the gateway's last reply, then the new question. With the
    conversation named, that reply alone ties it to the branch."""
    headers = {HEADER: f"window-{uuid.uuid4().hex}"}
    said: list[dict[str, Any]] = []
    for turn in range(3):
        said.append({"role": "user", "content": f"Question {turn}: when do roses bloom?"})
        answer = http.post(CHAT, json={"model": "m", "messages": said[-2:]}, headers=headers)
        assert answer.status_code == 200, answer.text
        said.append({"role": "assistant", "content": reply_of(answer)})
    current, stored = branch(http, headers[HEADER])
    assert current == [m["content"] for m in said]
    assert stored == len(said)


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
def test_a_client_that_folds_old_turns_into_a_summary_keeps_one_branch(
    http: httpx.Client, named: bool
) -> None:
    """A summary-buffer memory (LangChain's `ConversationSummaryBufferMemory` and its kin):
    the system prompt, a system message summarizing the older turns (new each time), then the
    last turns."""
    tag = uuid.uuid4().hex[:8]
    headers = {HEADER: f"summary-{tag}"} if named else {}
    system = {"role": "system", "content": f"You are terse. [{tag}]"}
    said: list[dict[str, Any]] = []
    conversations = set()
    for turn in range(TURNS):
        said.append({"role": "user", "content": f"Question {turn} about pruning [{tag}]"})
        folded = len(said) - 4
        summary = [{"role": "system", "content": f"Earlier: {folded} messages."}] * (folded > 0)
        sent = [system, *summary, *said[-4:]]
        answer = http.post(CHAT, json={"model": "m", "messages": sent}, headers=headers)
        assert answer.status_code == 200, answer.text
        conversations.add(answer.headers[HEADER])
        said.append({"role": "assistant", "content": reply_of(answer)})
    [conversation] = conversations
    current, stored = branch(http, conversation)
    assert current == [m["content"] for m in [system, *said]]
    assert stored == 1 + len(said)


def test_an_agents_window_that_ends_in_a_tool_exchange_keeps_one_conversation(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    """An agent that trims its history sends, at each step, a window whose last assistant
    message is the model's tool call, with no text: without a conversation id, the gateway's
    recorded call (by its id, unique) ties the window to its conversation."""
    tag = uuid.uuid4().hex[:8]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    system = {"role": "system", "content": f"You are an agent. [{tag}]"}
    said: list[dict[str, Any]] = []
    conversations = set()

    def step() -> dict[str, Any]:
        body = {"model": "m", "messages": [system, *said[-5:]], "tools": tools}
        answer = http.post(CHAT, json=body)
        assert answer.status_code == 200, answer.text
        conversations.add(answer.headers[HEADER])
        message: dict[str, Any] = answer.json()["choices"][0]["message"]
        return message

    for turn in range(4):
        said.append({"role": "user", "content": f"Task {turn} [{tag}]"})
        upstream.script({"tool_calls": [{"name": "lookup", "arguments": {"task": turn}}]})
        [call] = step()["tool_calls"]
        said.append({"role": "assistant", "content": None, "tool_calls": [call]})
        said.append({"role": "tool", "tool_call_id": call["id"], "content": f"found {turn}"})
        said.append({"role": "assistant", "content": step()["content"]})
    assert len(conversations) == 1
    [conversation] = conversations
    current, stored = branch(http, conversation)
    assert stored == 1 + len(said)
    assert len(current) == stored


def test_langchain_trimming_its_history_keeps_one_conversation(
    gateway: GatewayProcess, http: httpx.Client, upstream: UpstreamServer
) -> None:
    """`trim_messages` keeps the system prompt and the last messages that fit, starting on a
    human message: what a langchain app sends once its history outgrows its model."""
    system = f"You garden. [{uuid.uuid4().hex}]"
    llm = ChatOpenAI(model="m", base_url=gateway.url, api_key="sk-langchain", max_retries=0)
    history: list[BaseMessage] = [SystemMessage(system)]
    for turn in range(TURNS):
        history.append(HumanMessage(f"When do I plant bulb {turn}?"))
        window = trim_messages(
            history,
            strategy="last",
            token_counter=len,
            max_tokens=4,
            start_on="human",
            include_system=True,
        )
        reply = llm.invoke(window)
        history.append(AIMessage(reply.content))
    conversations = {
        c["conversation"]
        for c in http.get("/admin/conversations", params={"limit": 100}).json()["data"]
    }
    ours = [c for c in conversations if branch(http, c)[0][:1] == [system]]
    assert len(ours) == 1
    current, stored = branch(http, ours[0])
    assert current == [message.content for message in history]
    assert stored == 1 + 2 * TURNS
    # It fits the budget: sent as langchain sent it.
    prompt = upstream.requests(CHAT)[-1]["body"]["messages"]
    assert [m["content"] for m in prompt] == [message.content for message in window]


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
def test_a_window_whose_last_question_was_edited_branches_where_it_was_asked(
    http: httpx.Client, named: bool
) -> None:
    """A chat app that trims its history lets the user rewrite the last question: the window
    then ends with the rewritten question after the reply before it. The old question and its
    answer leave the branch (kept); nothing of the window is stored again (it used to be
    appended after the head with the conversation named, and start a new conversation
    without)."""
    tag = uuid.uuid4().hex[:8]
    headers = {HEADER: f"edit-{tag}"} if named else {}
    said: list[dict[str, Any]] = []
    named_as = set()
    for turn in range(5):
        said.append({"role": "user", "content": f"Question {turn} about the hedge [{tag}]"})
        answer = http.post(CHAT, json={"model": "m", "messages": said[-4:]}, headers=headers)
        assert answer.status_code == 200, answer.text
        named_as.add(answer.headers[HEADER])
        said.append({"role": "assistant", "content": reply_of(answer)})
    dropped = said[-2:]
    said[-2:] = [{"role": "user", "content": f"Question 4, put better [{tag}]"}]
    answer = http.post(CHAT, json={"model": "m", "messages": said[-4:]}, headers=headers)
    assert answer.status_code == 200, answer.text
    named_as.add(answer.headers[HEADER])
    said.append({"role": "assistant", "content": reply_of(answer)})
    [conversation] = named_as
    current, stored = branch(http, conversation)
    assert current == [m["content"] for m in said]
    assert stored == len(said) + len(dropped)


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
def test_an_agents_question_edited_after_rounds_of_parallel_tool_calls_branches_there(
    http: httpx.Client, upstream: UpstreamServer, named: bool
) -> None:
    """An agent's question answered after three rounds of two parallel tool calls is ten
    messages before the head; the user rewrites it, and the trimmed history ends with the new
    question after the answer before it, 11 messages back. It branches there (a window reached
    back 8 at most: without the header a new conversation began; with it the old question
    and its rounds stayed on the branch, the window appended after them)."""
    tag = uuid.uuid4().hex[:8]
    headers = {HEADER: f"agent-{tag}"} if named else {}
    tools = [{"type": "function", "function": {"name": "count_trees", "parameters": {}}}]
    said: list[dict[str, Any]] = []
    named_as = set()

    def send(script: dict[str, Any] | None = None) -> dict[str, Any]:
        if script:
            upstream.script(script)
        body = {"model": "m", "messages": said[-6:], "tools": tools}
        answer = http.post(CHAT, json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        named_as.add(answer.headers[HEADER])
        message: dict[str, Any] = answer.json()["choices"][0]["message"]
        return message

    for turn in range(4):  # the window (the last 6 messages) holds none of these at the end
        said.append({"role": "user", "content": f"Question {turn} about the orchard [{tag}]"})
        said.append({"role": "assistant", "content": send()["content"]})
    said.append({"role": "user", "content": f"Count rows 1 to 6 [{tag}]"})
    asked = len(said) - 1
    for first in (1, 3, 5):
        calls = [{"name": "count_trees", "arguments": {"row": row}} for row in (first, first + 1)]
        made = send({"tool_calls": calls})["tool_calls"]
        said.append({"role": "assistant", "content": None, "tool_calls": made})
        said.extend(
            {"role": "tool", "tool_call_id": call["id"], "content": f"{i} trees [{tag}]"}
            for i, call in enumerate(made)
        )
    said.append({"role": "assistant", "content": send()["content"]})
    dropped = len(said) - asked
    said[asked:] = [{"role": "user", "content": f"Count rows 1 to 2 only [{tag}]"}]
    said.append({"role": "assistant", "content": send()["content"]})
    [conversation] = named_as
    current, stored = branch(http, conversation)
    assert current == [m["content"] for m in said]
    assert stored == len(said) + dropped


async def test_a_windowed_edit_while_the_build_writes_the_messages_it_drops_is_answered(
    app: App, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window that edits its last question, sent while the background build writes the
    vectors of the messages the edit drops (the open segment's: the newest messages). The
    move's UPDATE locks them in the order its plan reads them (by chain hash through
    `ix_nodes_conversation_chain` in a deployed client model's database), the build one by one
    in seq order. That the two orders differ is forced here: the build's first write is the
    row the move locks last, and the build waits there until the request waits for a lock.
    Each then held a row the other waited for, and Postgres broke the deadlock by failing the
    request's transaction: a 500. The build now takes the conversation's key-share lock before
    it writes, which the move's update lock waits for before it touches a message."""
    tag = uuid.uuid4().hex[:8]
    said: list[dict[str, Any]] = []
    async with app.client(raise_app_exceptions=False) as http:

        async def send(window: list[dict[str, Any]]) -> httpx.Response:
            return await http.post(CHAT, json={"model": "m", "messages": window})

        for turn in range(3):
            said.append({"role": "user", "content": f"Question {turn} about pears [{tag}]"})
            answer = await send(said[-3:])
            assert answer.status_code == 200, answer.text
            said.append({"role": "assistant", "content": reply_of(answer)})
        external_id = answer.headers[HEADER]
        async with engine.connect() as conn:
            tenant_id, conversation_id = (
                await conn.execute(
                    select(conversations.c.tenant_id, conversations.c.id).where(
                        conversations.c.external_id == external_id
                    )
                )
            ).one()
        # The edit of the last question (seq 4) drops it and its answer: the order in which the
        # move will lock them, read from the same UPDATE rolled back.
        async with engine.connect() as conn, conn.begin() as probe:
            params = {"conversation": conversation_id, "fork": 3, "restore": []}
            order = [row.seq for row in await conn.execute(branches._MOVE, params)]
            last = await conn.scalar(
                select(nodes.c.id).where(
                    nodes.c.conversation_id == conversation_id,
                    nodes.c.level == 0,
                    nodes.c.seq == order[-1],
                )
            )
            await probe.rollback()
        assert sorted(order) == [4, 5]

        held, go = asyncio.Event(), asyncio.Event()
        write = indexing.write

        async def held_write(
            conn: AsyncConnection, writes: Sequence[Any], *, tenant_id: int
        ) -> None:
            if any(node == last for node, _, _ in writes):
                first = [w for w in writes if w[0] == last]
                await write(conn, first, tenant_id=tenant_id)
                held.set()
                await go.wait()
                writes = [w for w in writes if w[0] != last]
            await write(conn, writes, tenant_id=tenant_id)

        monkeypatch.setattr(indexing, "write", held_write)
        # Segments that nothing closes: every message is the open segment's.
        config = tree.TreeConfig(
            embedder=app.state.embedder,
            summarizer=ExtractiveSummarizer("gpt-4o"),
            policy=SegmentPolicy(shift_threshold=2.0),
        )
        building = asyncio.ensure_future(
            tree.build(engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config)
        )
        await asyncio.wait_for(held.wait(), 60)
        said[-2:] = [{"role": "user", "content": f"Question 2 about plums [{tag}]"}]
        editing = asyncio.ensure_future(send(said[-3:]))
        await _waiting_for_a_lock(engine)
        go.set()
        answer = await editing
        await building
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER] == external_id


async def _waiting_for_a_lock(engine: AsyncEngine) -> None:
    """Once a backend of the database waits for a lock."""
    for _ in range(1000):
        async with engine.connect() as conn:
            waiting = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("nothing waits for a lock")
