"""`serve`'s worker process SIGKILLed while the upstream holds one of its summaries.

`memstrata serve` runs its jobs in a child process (`gateway.worker_process`) and starts
another when that one dies. Here the child is killed in the middle of a conversation's build,
while the fake upstream holds the build's first segment summary: `serve` starts a new child,
which takes the job over once the dead child's lease has run out and finishes the build. The
held summary is asked for again and stored once, the job is done at its second attempt, no
message is lost or stored twice, and `serve` answered chat requests all along.

(`tests/test_workers.py` shows the same takeover between separate `memstrata worker`
processes.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.openai.turn import CONVERSATION_HEADER
from memory.schema import DEFAULT_TENANT, nodes, tenants
from memory.write import store
from tests import own_database
from tests.test_workers import (
    KILLED_POLICY,
    KILLED_TOKEN_CAP,
    MESSAGES,
    check_no_duplicates,
    check_tree,
    child_pids,
    import_one,
    job_rows,
    summary_taking,
    wait_for,
)

# This module's own database (serve's worker process runs every queued job).
database_url = own_database.database_url
engine = own_database.engine

# Real embeddings in two worker processes, one after the other: minutes on a busy machine.
pytestmark = pytest.mark.timeout(600)

CHAT = "/v1/chat/completions"
# How long the upstream holds the first segment summary: longer than the test runs, so that
# only the worker process's death ends that request.
HOLD = 600.0
# Short, so that the dead child's job is taken over soon; its live holder extends it every
# second.
LEASE_SECONDS = 3.0
# Both kinds of summary prompt say this (`memory.build.summarize`); a chat turn does not.
SUMMARY_PROMPT = "(oldest first)"
FIRST_SEGMENT_PROMPT = "Summarize these"


def prompt(request: dict[str, Any]) -> str:
    """The last message of a recorded chat request: a summary's prompt."""
    return str(request["body"]["messages"][-1]["content"])


async def messages_of(engine: AsyncEngine, conversation_id: int) -> list[tuple[Any, ...]]:
    """A conversation's stored messages, `(id, seq, role, text)` in order."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(nodes.c.id, nodes.c.seq, nodes.c.role, nodes.c.text)
            .where(nodes.c.conversation_id == conversation_id, nodes.c.level == 0)
            .order_by(nodes.c.seq)
        )
        return [tuple(row) for row in rows]


async def keep_chatting(url: str, name: str, stop: asyncio.Event) -> list[dict[str, str]]:
    """Turns of conversation `name` through `serve`, one a second until `stop` is set (at
    least one): the messages sent and answered, every answer checked on arrival."""
    history: list[dict[str, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not (history and stop.is_set()):
            question = f"question {len(history) // 2} while the worker process is replaced"
            history.append({"role": "user", "content": question})
            response = await client.post(
                "/chat/completions",
                json={"model": "gpt-4o", "messages": history},
                headers={CONVERSATION_HEADER: name},
            )
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]["message"]["content"]
            assert answer == f"echo: {question}"
            history.append({"role": "assistant", "content": answer})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1)
    return history


async def test_serve_s_new_worker_process_takes_over_the_killed_one_s_job(
    engine: AsyncEngine, database_url: str, tenant_id: int, upstream: UpstreamServer
) -> None:
    upstream.set_default({**summary_taking(0), "match": SUMMARY_PROMPT})
    # Strict FIFO: the first segment summary asked for takes this; every later one the default.
    upstream.script({**summary_taking(HOLD), "match": FIRST_SEGMENT_PROMPT})
    gateway = GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=1,
        worker_nice=0,
        worker_grace_seconds=1,
        job_lease_seconds=LEASE_SECONDS,
        summary_mode="llm",
        summary_model="summary-model",
        segment_token_cap=KILLED_TOKEN_CAP,
    )
    try:
        conversation_id = await import_one(engine, tenant_id, "taken-over", seed=23)

        async def held() -> str | None:
            requests = upstream.requests(CHAT)
            return next((prompt(r) for r in requests if r["behaviour"].get("delay") == HOLD), None)

        held_prompt = await wait_for(held, within=180, what="the held summary", workers=[gateway])
        stored = await messages_of(engine, conversation_id)
        (job,) = await job_rows(engine, tenant_id)
        assert (job.status, job.attempts) == ("running", 1)
        killed = int(job.locked_by.split(":")[1])
        assert killed in child_pids(gateway.pid)
        os.kill(killed, signal.SIGKILL)

        async def taken_over() -> Any:
            (row,) = await job_rows(engine, tenant_id)
            return row if row.status == "done" else None

        # Requests keep coming while serve has no worker process, and while the new one starts
        # and runs the job. A failed request ends the wait (the task group cancels it), and a
        # failed wait the requests.
        stop_chatting = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            chatting = group.create_task(keep_chatting(gateway.url, "meanwhile", stop_chatting))
            finished = await wait_for(
                taken_over, within=300, what="the job taken over and done", workers=[gateway]
            )
            stop_chatting.set()
        history = chatting.result()
        children = child_pids(gateway.pid)
        logs = gateway.logs()
    finally:
        gateway.stop()

    assert f"background worker process {killed} exited with code -9" in logs, logs[-3000:]
    # Taken over by serve's new child, at the job's second claim (one attempt spent by the
    # dead child), with no failure recorded.
    replacement = int(finished.locked_by.split(":")[1])
    assert replacement != killed
    assert replacement in children
    assert (finished.id, finished.attempts, finished.last_error) == (job.id, 2, None)

    # The held summary was asked for again, by the new child, and is stored once.
    prompts = [prompt(r) for r in upstream.requests(CHAT) if SUMMARY_PROMPT in prompt(r)]
    assert prompts.count(held_prompt) == 2
    summarized = [int(node) for node in re.findall(r"\[#(\d+)\]", held_prompt)]
    async with engine.connect() as conn:
        parents = set(
            await conn.scalars(select(nodes.c.parent_id).where(nodes.c.id.in_(summarized)))
        )
    assert len(parents) == 1 and None not in parents, parents
    await check_no_duplicates(engine, tenant_id)
    await check_tree(engine, tenant_id, conversation_id, MESSAGES, "llm", KILLED_POLICY)

    # Nothing lost, nothing stored twice: the imported messages as they were, and every turn
    # of the conversation served meanwhile once, in order.
    assert await messages_of(engine, conversation_id) == stored
    assert [seq for _, seq, _, _ in stored] == list(range(MESSAGES))
    async with engine.connect() as conn:
        default = await conn.scalar(select(tenants.c.id).where(tenants.c.name == DEFAULT_TENANT))
        assert default is not None
        meanwhile = await store.find_conversation(conn, tenant_id=default, external_id="meanwhile")
    served = await messages_of(engine, meanwhile.id)
    assert [(role, text) for _, _, role, text in served] == [
        (message["role"], message["content"]) for message in history
    ]
