"""End to end: the openai Node SDK (`node`, `tests/node/client.mjs`) and the Vercel AI SDK
(`tests/node/ai_sdk.mjs`) as clients of a gateway process in front of the fake upstream: chat
completions and the Responses API, streamed and not, and the Node SDK reading one response over
the gateway's memory-tool rounds (`tests/node/memory_rounds.mjs`).

The SDKs are installed from npm into `tests/node/node_modules` (`npm ci`, pinned by
`tests/node/package-lock.json`) the first time the test runs. The test is skipped, saying why,
only where `node` or `npm` is missing or npm cannot reach its registry.
"""

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer

NODE_PROJECT = Path(__file__).resolve().parent / "node"


@pytest.fixture(scope="module")
def node_sdk() -> str:
    """The `node` binary, with the SDK installed beside the client script."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the openai Node SDK test needs node and npm, which are not installed")
    wanted = json.loads((NODE_PROJECT / "package.json").read_text())["dependencies"]
    if not all((NODE_PROJECT / "node_modules" / name).is_dir() for name in wanted):
        installed = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_PROJECT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if installed.returncode != 0:
            pytest.skip(f"npm could not install the Node SDKs:\n{installed.stderr[-2000:]}")
    return node


@pytest.fixture(scope="module")
def gateway(database_url: str) -> Iterator[tuple[UpstreamServer, GatewayProcess]]:
    with (
        UpstreamServer() as upstream,
        GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as gw,
    ):
        yield upstream, gw


def run_node(node: str, script: str, gw: GatewayProcess, tag: str) -> Any:
    run = subprocess.run(
        [node, str(NODE_PROJECT / script)],
        env={**os.environ, "GATEWAY_URL": gw.url, "TAG": tag},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_the_node_sdk_chats_and_responds_through_the_gateway(
    node_sdk: str, gateway: tuple[UpstreamServer, GatewayProcess]
) -> None:
    upstream, gw = gateway
    tag = uuid.uuid4().hex
    out = run_node(node_sdk, "client.mjs", gw, tag)

    assert out["chat"] == f"echo: node chat {tag}"
    assert out["chatStream"] == f"echo: node stream {tag}"
    words = ("one", "two", "three")
    assert out["responses"] == [f"echo: node responses {w} {tag}" for w in words]
    assert out["retrieved"] == out["responses"][-1]

    # The chat history resent whole continued the first conversation, each message once.
    with httpx.Client(base_url=gw.root_url, timeout=10) as http:
        chat = http.get(f"/admin/conversations/{out['chatConversation']}/messages").json()
    assert [m["content"] for m in chat["messages"]] == [
        f"node chat {tag}",
        out["chat"],
        f"node stream {tag}",
        out["chatStream"],
    ]
    # The third response's request carried the whole history upstream.
    last = upstream.requests("/v1/responses")[-1]["body"]["input"]
    assert [item["content"] for item in last] == [
        f"node responses one {tag}",
        out["responses"][0],
        f"node responses two {tag}",
        out["responses"][1],
        f"node responses three {tag}",
    ]


def pairs(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(role, text) of each stored message, a list of text parts read as its text."""
    return [
        (
            m["role"],
            "\n".join(p["text"] for p in m["content"])
            if isinstance(m["content"], list)
            else m["content"],
        )
        for m in messages
    ]


def test_the_vercel_ai_sdk_keeps_one_conversation_with_each_message_once(
    node_sdk: str, gateway: tuple[UpstreamServer, GatewayProcess]
) -> None:
    """The AI SDK's Responses provider sends an earlier reply back as an `item_reference` (it
    was refused: every chat failed on its second turn), and with `conversation` its tool loop
    resends the step's question with the results (it was stored again, between the call and
    its results)."""
    upstream, gw = gateway
    tag = uuid.uuid4().hex
    for reply, city in (("Checking.", "Kyiv"), ("And Lviv.", "Lviv")):
        upstream.script(
            {
                "match": f"weather in Kyiv {tag}",
                "reply": reply,
                "tool_calls": [{"name": "weather", "arguments": {"city": city}}],
            }
        )
    out = run_node(node_sdk, "ai_sdk.mjs", gw, tag)
    chat = [f"ai chat {word} {tag}" for word in ("one", "two", "three")]
    assert out["chat"] == [f"echo: {text}" for text in chat]
    [conversation] = out["chatConversations"]
    with httpx.Client(base_url=gw.root_url, timeout=10) as http:
        stored = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
        named = http.get(f"/admin/conversations/ai-named-{tag}/messages").json()["messages"]
    assert pairs(stored) == [
        ("system", "Be brief."),
        *(
            (role, text)
            for question in chat
            for role, text in (("user", question), ("assistant", f"echo: {question}"))
        ),
    ]
    asked = [f"hello {tag}", f"weather in Kyiv {tag}", f"thanks {tag}"]
    assert out["named"] == [f"echo: {text}" for text in asked]
    assert pairs(named) == [
        ("user", asked[0]),
        ("assistant", out["named"][0]),
        ("user", asked[1]),
        ("assistant", "Checking."),
        ("tool", "sunny in Kyiv"),
        ("assistant", "And Lviv."),
        ("tool", "sunny in Lviv"),
        ("assistant", out["named"][1]),
        ("user", asked[2]),
        ("assistant", out["named"][2]),
    ]


def test_the_node_sdk_reads_one_response_over_the_gateways_memory_rounds(
    node_sdk: str, database_url: str
) -> None:
    """The model calls a memory tool before answering, streamed and not: the Node SDK reads
    one response (one `response.created`, the same id at its end), with no memory call."""
    tag = uuid.uuid4().hex
    with (
        UpstreamServer() as upstream,
        GatewayProcess(
            database_url=database_url,
            upstream_url=upstream.url,
            workers=0,
            memory_tools="always",
            upstream_responses="on",
        ) as gw,
    ):
        memory_call = {"tool_calls": [{"name": "memory_find", "arguments": {"pattern": tag}}]}
        upstream.script(
            memory_call,
            {"reply": f"streamed after reading {tag}"},
            memory_call,
            {"reply": f"whole after reading {tag}"},
        )
        out = run_node(node_sdk, "memory_rounds.mjs", gw, tag)
        rounds = upstream.requests("/v1/responses")

    assert out["streamText"] == f"streamed after reading {tag}"
    assert out["kinds"].count("response.created") == 1
    assert out["kinds"][-1] == "response.completed"
    assert not any("function_call" in kind for kind in out["kinds"])
    assert out["completed"]["id"] == out["createdId"]
    assert [item["type"] for item in out["completed"]["output"]] == ["message"]
    assert out["wholeText"] == f"whole after reading {tag}"
    assert out["wholeOutput"] == ["message"]
    # Each request took two rounds upstream; the second read what the memory call found.
    assert len(rounds) == 4
    outputs = [
        item for item in rounds[1]["body"]["input"] if item.get("type") == "function_call_output"
    ]
    assert len(outputs) == 1 and tag in outputs[0]["output"]
