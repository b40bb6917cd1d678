"""End to end, model-based: what real clients do to a conversation, in random order, against a
`memstrata serve` process and the fake upstream process.

Each client keeps its own view of its conversation, as a chat app does, and sends it in one of
the shapes clients use: the whole history, a window of its latest messages, or (naming the
conversation) only what is new; with or without the conversation header, streamed or not. Its
steps are drawn from a seeded generator: ask something new, run a tool round (half the results
long enough to be masked once outside the fresh tail), retry the last request (an SDK's retry of
the same bytes, the answer already recorded: stored only if it differs, in the first's place),
regenerate the last answer (the same messages in another request: a new answer, stored beside
the first), or edit an earlier question of its own and ask again from there. After every step
the gateway's current branch must be exactly the client's view, every answer must name the one
conversation, and every message the client ever had must be stored once: an edit leaves the old
branch stored, superseded, and nothing is stored twice.

Clients of the Responses API the same way: resending their whole input, continuing the latest
response (`previous_response_id`, also from an earlier one: a fork), or naming their
conversation (`conversation`).

As deployed: the same steps through two `serve` processes on one database, each request sent to
either (a load balancer's choice), each process with its worker building segments, summaries,
the next turn's recall and the next compaction while the client goes on; half way, a process is
killed while a question's answer is upstream, and the client retries it.
"""

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from devkit.deployment import Balanced, Deployment, settled
from devkit.upstream import UpstreamServer

pytestmark = pytest.mark.usefixtures("fresh_upstream")

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
STEPS = 24
TOOLS = [{"type": "function", "function": {"name": "count_trees", "parameters": {}}}]


@pytest.fixture(scope="module")
def deployed(module_database_url: str, upstream: UpstreamServer) -> Iterator[Deployment]:
    """Two `serve` processes on one database of this module's own (their workers run every
    queued job)."""
    with ExitStack() as stack:
        # Segments close at the least they may, so that summaries and their roll-ups are built
        # within a few turns; summaries extractive.
        deployment = Deployment(
            module_database_url,
            upstream,
            stack,
            summary_mode="extractive",
            segment_token_cap=64,
            segment_min_tokens=0,
            fanout=2,
        )
        http = stack.enter_context(httpx.Client(timeout=30))
        # Workers load their models on their first jobs: those are waited for, so that the
        # builds keep up with the clients from their first steps.
        for gateway in deployment.gateways:
            first = [{"role": "user", "content": f"Warm up {uuid.uuid4().hex}"}]
            answer = http.post(
                f"{gateway.url}/chat/completions", json={"model": "m", "messages": first}
            )
            settled(http, answer.headers[HEADER], root=gateway.root_url)
        yield deployment


@dataclass
class Client:
    """One chat app's conversation, as the app sees it."""

    shape: str  # "history", "window" or "new" (only the new messages, the conversation named)
    named: bool
    system: bool
    budget: int
    rng: random.Random
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    view: list[dict[str, Any]] = field(default_factory=list)
    ever: int = 0  # messages the view ever held: each must be stored once
    # The last request: its messages, whether it streamed, the tools it offered.
    last: tuple[list[dict[str, Any]], bool, list[Any] | None] | None = None
    conversations: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.system:
            self.add({"role": "system", "content": f"You answer tersely. [{self.tag}]"})

    def add(self, message: dict[str, Any]) -> None:
        self.view.append(message)
        self.ever += 1

    def headers(self) -> dict[str, str]:
        headers = {"X-Memstrata-Budget": str(self.budget)}
        if self.named:
            headers[HEADER] = f"model-{self.tag}"
        return headers

    def sent(self, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the client sends once `new` is in its view."""
        if self.shape == "new" and self.last is not None:
            return new
        opening = self.view[:1] if self.system else []
        turns = self.view[len(opening) :]
        if self.shape == "window" and len(turns) > 4:
            # At least its last reply and the question before it, then what is new.
            turns = turns[-self.rng.randint(len(new) + 2, len(new) + 5) :]
        return [*opening, *turns]


def text_of(*args: Any, **kwargs: Any) -> str:
    """The text of `reply`'s message."""
    return str(reply(*args, **kwargs)["content"])


def reply(
    http: httpx.Client,
    client: Client,
    messages: list[dict[str, Any]],
    *,
    stream: bool,
    tools: list[Any] | None = None,
    retrying: bool = False,
) -> dict[str, Any]:
    """The reply message (a stream's put together); the conversation it names is noted."""
    client.last = (messages, stream, tools)
    headers = client.headers()
    if retrying:
        headers["X-Stainless-Retry-Count"] = "1"
    body: dict[str, Any] = {
        "model": "m",
        "messages": messages,
        **({"tools": tools} if tools else {}),
    }
    if stream:
        with http.stream("POST", CHAT, json={**body, "stream": True}, headers=headers) as answer:
            assert answer.status_code == 200, answer.read()
            client.conversations.add(answer.headers[HEADER])
            text, calls = "", dict[int, dict[str, Any]]()
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[len("data: ") :])["choices"]:
                        text += choice["delta"].get("content") or ""
                        for part in choice["delta"].get("tool_calls") or []:
                            call = calls.setdefault(
                                part["index"],
                                {"type": "function", "function": {"name": "", "arguments": ""}},
                            )
                            call.update({"id": part["id"]} if part.get("id") else {})
                            for key, value in (part.get("function") or {}).items():
                                call["function"][key] += value or ""
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": list(calls.values())}
            return {"role": "assistant", "content": text}
    answer = http.post(CHAT, json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    client.conversations.add(answer.headers[HEADER])
    message: dict[str, Any] = answer.json()["choices"][0]["message"]
    return message


def ask(http: httpx.Client, client: Client, step: int) -> None:
    question = {"role": "user", "content": f"Question {step} about the orchard [{client.tag}]"}
    client.add(question)
    reply = text_of(http, client, client.sent([question]), stream=client.rng.random() < 0.5)
    client.add({"role": "assistant", "content": reply})


def retry(http: httpx.Client, upstream: UpstreamServer, client: Client, step: int) -> None:
    """The last request again, byte for byte, as an SDK retries one whose answer it lost. It
    goes upstream again; a model may answer as before or anew, and the client shows that."""
    assert client.last is not None
    messages, stream, tools = client.last
    first = client.view[-1]["content"]
    upstream.script(
        {"reply": first if client.rng.random() < 0.5 else f"Anew, {step} [{client.tag}]"}
    )
    again = text_of(http, client, messages, stream=stream, tools=tools, retrying=True)
    if again != first:  # the first answer leaves the branch, stored; the retry's is stored
        del client.view[-1]
        client.add({"role": "assistant", "content": again})


def regenerate(http: httpx.Client, upstream: UpstreamServer, client: Client, step: int) -> None:
    """The last answer asked for again: the same messages, in a request of another form, and
    the model answers otherwise."""
    assert client.last is not None
    messages, stream, tools = client.last
    upstream.script({"reply": f"Another answer, the {step}th [{client.tag}]"})
    del client.view[-1]
    again = text_of(http, client, messages, stream=not stream, tools=tools)
    client.add({"role": "assistant", "content": again})


def use_a_tool(http: httpx.Client, upstream: UpstreamServer, client: Client, step: int) -> None:
    """A task the model answers with one call of the client's tool, or two at once (parallel
    tool calls): the client runs them, sends the results, and gets the answer (an agent's
    round)."""
    task = {"role": "user", "content": f"Task {step} in the orchard [{client.tag}]"}
    client.add(task)
    rows = range(step, step + client.rng.choice([1, 2]))
    upstream.script(
        {"tool_calls": [{"name": "count_trees", "arguments": {"row": row}} for row in rows]}
    )
    stream = client.rng.random() < 0.5
    calls = reply(http, client, client.sent([task]), stream=stream, tools=TOOLS)["tool_calls"]
    assert len(calls) == len(rows)
    client.add({"role": "assistant", "content": None, "tool_calls": calls})
    results = []
    for row, call in zip(rows, calls, strict=True):
        # Half the results are long, as a file or a page read by a tool is: once a compaction
        # leaves one outside the fresh tail, it is masked (observation masking).
        trees = " ".join(f"tree {n} of row {row}: apples" for n in range(client.rng.choice([1, 9])))
        results.append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": f"Row {row}, task {step}: {trees}",
            }
        )
        client.add(results[-1])
    # An answer of its own: the default echoes the last user message, which a window that
    # starts after the task does not hold ("echo: " for every such round).
    upstream.script({"reply": f"Counted for task {step} [{client.tag}]"})
    answer = text_of(
        http, client, client.sent(results), stream=client.rng.random() < 0.5, tools=TOOLS
    )
    client.add({"role": "assistant", "content": answer})


def edit(http: httpx.Client, client: Client, step: int) -> None:
    """An earlier question of the client's rewritten, and asked again from there."""
    questions = [i for i, m in enumerate(client.view) if m["role"] == "user"]
    # The first question rewritten is another chat, or (the conversation named) a new message
    # after the system prompt (README, "Branches").
    questions = questions[1:]
    if not questions:
        return ask(http, client, step)
    # A window reaches back a few exchanges (`memory.write.windows.EDITS`).
    index = client.rng.choice(questions[-3:] if client.shape == "history" else questions[-2:])
    del client.view[index:]
    ask(http, client, step)


def crash_mid_turn(
    http: httpx.Client,
    deployment: Deployment,
    upstream: UpstreamServer,
    client: Client,
    step: int,
) -> None:
    """A question whose `serve` process is killed while its answer is upstream: the request
    fails, and the client retries the same bytes (to either process, the killed one started
    again). The question, stored before it went upstream, stays stored once; the retry's answer
    is recorded."""
    question = {"role": "user", "content": f"Question {step}, as a process dies [{client.tag}]"}
    client.add(question)
    messages = client.sent([question])
    victim = deployment.gateways[0]
    upstream.script({"delay": 5.0, "reply": f"Never seen [{client.tag}]"})
    sent = len(upstream.requests(CHAT))
    failed: list[httpx.TransportError] = []

    def send() -> None:
        body = {"model": "m", "messages": messages}
        try:
            httpx.post(f"{victim.url}/chat/completions", json=body, headers=client.headers())
        except httpx.TransportError as error:
            failed.append(error)

    request = threading.Thread(target=send)
    request.start()
    for _ in range(100):
        if len(upstream.requests(CHAT)) > sent:
            break
        time.sleep(0.05)
    deployment.restart(0)
    request.join()
    assert failed
    answer = text_of(http, client, messages, stream=False, retrying=True)
    client.add({"role": "assistant", "content": answer})


def check(http: httpx.Client, upstream: UpstreamServer, client: Client) -> None:
    assert len(client.conversations) == 1, client.conversations
    [conversation] = client.conversations
    answer = http.get(f"/admin/conversations/{conversation}/messages", params={"limit": 500})
    assert answer.status_code == 200, answer.text
    stored = answer.json()["messages"]
    current = [m["content"] for m in stored if m["superseded_at"] is None]
    assert current == [m["content"] for m in client.view]
    assert len(stored) == client.ever
    # What left the branch is not in the prompt (each message's text is unique).
    prompt = json.dumps(upstream.requests(CHAT)[-1]["body"]["messages"])
    left = [m["content"] for m in stored if m["superseded_at"] and m["content"]]
    assert not [content for content in left if content in prompt]


SHAPES = pytest.mark.parametrize(
    ("shape", "named"),
    [("history", False), ("history", True), ("window", False), ("window", True), ("new", True)],
    ids=["history", "history-named", "window", "window-named", "new-named"],
)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("budget", [8000, 600], ids=["fits", "past-budget"])
@SHAPES
def test_a_clients_random_steps_keep_its_view_and_store_each_message_once(
    http: httpx.Client, upstream: UpstreamServer, shape: str, named: bool, budget: int, seed: int
) -> None:
    run_client(
        http, upstream, random.Random(f"{shape}-{named}-{budget}-{seed}"), shape, named, budget
    )


@pytest.mark.parametrize("seed", [1, 2])
@SHAPES
def test_the_same_through_two_serve_processes_with_their_workers(
    deployed: Deployment, upstream: UpstreamServer, shape: str, named: bool, seed: int
) -> None:
    rng = random.Random(f"deployed-{shape}-{named}-{seed}")
    with Balanced(deployed, random.Random(seed)) as http:

        def crash(client: Client, step: int) -> None:
            crash_mid_turn(http, deployed, upstream, client, step)

        try:
            client = run_client(http, upstream, rng, shape, named, budget=600, crash=crash)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{deployed.failures(str(failure))}") from failure
        # The workers built while the client went on, past the budget (a working context);
        # what they built leaves the branch as it was.
        [conversation] = client.conversations
        stats = settled(http, conversation)
        assert stats["levels"].get("1", 0) > 0, stats
        assert stats["working_context"] is not None, stats
        check(http, upstream, client)


def run_client(
    http: httpx.Client,
    upstream: UpstreamServer,
    rng: random.Random,
    shape: str,
    named: bool,
    budget: int,
    crash: Callable[[Client, int], None] | None = None,
) -> Client:
    """`STEPS` steps of one client, drawn from `rng`, each checked; half way, `crash` when
    given."""
    client = Client(shape=shape, named=named, system=rng.random() < 0.5, budget=budget, rng=rng)
    steps: list[str] = []
    for step in range(STEPS):
        draw = rng.random() if client.last is not None else 0.0
        try:
            if crash is not None and step == STEPS // 2:
                steps.append("crash")
                crash(client, step)
            elif draw < 0.6:
                steps.append("ask")
                ask(http, client, step)
            elif draw < 0.7:
                steps.append("tool")
                use_a_tool(http, upstream, client, step)
            elif draw < 0.8:
                steps.append("retry")
                retry(http, upstream, client, step)
            elif draw < 0.9 and shape != "new":  # the new messages only: nothing to regenerate
                steps.append("regenerate")
                regenerate(http, upstream, client, step)
            elif shape != "new":  # the new messages only cannot say what was edited
                steps.append("edit")
                edit(http, client, step)
            check(http, upstream, client)
        except AssertionError as failure:
            raise AssertionError(f"after {steps}: {failure}") from failure
    return client


# -- the Responses API -------------------------------------------------------------------------

RESPONSES = "/v1/responses"


@dataclass
class ResponsesClient:
    """One Responses API client: it resends its whole input (`input`), continues the latest
    response (`previous`), or names its conversation (`conversation`)."""

    shape: str
    budget: int
    rng: random.Random
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    view: list[tuple[str, str]] = field(default_factory=list)  # (role, text)
    items: list[Any] = field(default_factory=list)  # the whole input, as `input` resends it
    ever: int = 0
    answers: list[tuple[str, int, int]] = field(default_factory=list)  # response id, view, items
    last: dict[str, Any] | None = None
    conversations: set[str] = field(default_factory=set)


def respond(
    http: httpx.Client, client: ResponsesClient, body: dict[str, Any], **flags: bool
) -> Any:
    """The response object, streamed or not; the conversation it names is noted."""
    client.last = {**body, "stream": flags.get("stream", False)}
    headers = {"X-Memstrata-Budget": str(client.budget)}
    if flags.get("retrying"):
        headers["X-Stainless-Retry-Count"] = "1"
    if client.last["stream"]:  # sent as given: a retry's body is the same
        with http.stream("POST", RESPONSES, json=client.last, headers=headers) as answer:
            assert answer.status_code == 200, answer.read()
            client.conversations.add(answer.headers[HEADER])
            done = [
                json.loads(line[len("data: ") :])
                for line in answer.iter_lines()
                if line.startswith("data: {") and '"response.completed"' in line
            ]
            return done[-1]["response"]
    answer = http.post(RESPONSES, json=client.last, headers=headers)
    assert answer.status_code == 200, answer.text
    client.conversations.add(answer.headers[HEADER])
    return answer.json()


def said(response: Any) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def answered(client: ResponsesClient, response: Any) -> None:
    client.view.append(("assistant", said(response)))
    client.items.extend(response["output"])
    client.ever += 1
    client.answers.append((response["id"], len(client.view), len(client.items)))


def ask_responses(
    http: httpx.Client, client: ResponsesClient, step: int, previous: str | None = None
) -> None:
    """A new question; with `previous`, after that response (a fork when it is not the last)."""
    question = f"Question {step} about the vineyard [{client.tag}]"
    client.view.append(("user", question))
    client.items.append({"role": "user", "content": question})
    client.ever += 1
    body: dict[str, Any] = {"model": "m", "instructions": f"Be brief. [{client.tag}]"}
    if client.shape == "input":
        body["input"] = list(client.items)
    else:
        body["input"] = [client.items[-1]]
        if client.shape == "conversation":
            body["conversation"] = f"model-{client.tag}"
        elif previous or client.answers:
            body["previous_response_id"] = previous or client.answers[-1][0]
    answered(client, respond(http, client, body, stream=client.rng.random() < 0.5))


def again(
    http: httpx.Client,
    upstream: UpstreamServer,
    client: ResponsesClient,
    step: int,
    *,
    regenerate: bool,
) -> None:
    """The last request again: byte for byte (an SDK's retry; the model answers as before or
    anew), or in another form (the answer regenerated, anew)."""
    first = client.view[-1][1]
    anew = f"Anew, {step} [{client.tag}]"
    upstream.script({"reply": first if client.rng.random() < 0.5 and not regenerate else anew})
    assert client.last is not None
    body = dict(client.last)
    stream = body.pop("stream") != regenerate
    response = respond(http, client, body, retrying=not regenerate, stream=stream)
    client.view.pop()
    del client.items[client.answers.pop()[2] - 1 :]
    client.ever -= said(response) == first
    answered(client, response)


def check_responses(http: httpx.Client, client: ResponsesClient) -> None:
    assert len(client.conversations) == 1, client.conversations
    [conversation] = client.conversations
    answer = http.get(f"/admin/conversations/{conversation}/messages", params={"limit": 500})
    assert answer.status_code == 200, answer.text
    stored = [m for m in answer.json()["messages"] if m["role"] != "system"]

    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content)

    current = [(m["role"], text(m["content"])) for m in stored if m["superseded_at"] is None]
    assert current == client.view
    assert len(stored) == client.ever


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("budget", [8000, 600], ids=["fits", "past-budget"])
@pytest.mark.parametrize("shape", ["input", "previous", "conversation"])
def test_a_responses_clients_random_steps_keep_its_view_and_store_each_message_once(
    http: httpx.Client, upstream: UpstreamServer, shape: str, budget: int, seed: int
) -> None:
    """Its steps: ask, retry the last request (the model answers as before or anew),
    regenerate the last answer, and, continuing by `previous_response_id`, ask after an earlier
    response (a fork)."""
    run_responses_client(
        http, upstream, random.Random(f"responses-{shape}-{budget}-{seed}"), shape, budget
    )


@pytest.mark.parametrize("shape", ["input", "previous", "conversation"])
def test_a_responses_client_through_two_serve_processes_with_their_workers(
    deployed: Deployment, upstream: UpstreamServer, shape: str
) -> None:
    with Balanced(deployed, random.Random(shape)) as http:
        try:
            run_responses_client(http, upstream, random.Random(f"deployed-{shape}"), shape, 600)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{deployed.failures(str(failure))}") from failure


def run_responses_client(
    http: httpx.Client, upstream: UpstreamServer, rng: random.Random, shape: str, budget: int
) -> None:
    """`STEPS` steps of one Responses client, drawn from `rng`, each checked."""
    client = ResponsesClient(shape=shape, budget=budget, rng=rng)
    steps: list[str] = []
    for step in range(STEPS):
        draw = rng.random() if client.last is not None else 0.0
        try:
            if draw < 0.7:
                steps.append("ask")
                ask_responses(http, client, step)
            elif draw < 0.8:
                steps.append("retry")
                again(http, upstream, client, step, regenerate=False)
            elif draw < 0.9 and shape != "conversation":  # naming it, only new input is sent
                steps.append("regenerate")
                again(http, upstream, client, step, regenerate=True)
            elif shape == "previous" and len(client.answers) > 1:
                steps.append("fork")
                response_id, seen, items = rng.choice(client.answers[-3:-1])
                del client.view[seen:], client.items[items:]
                client.answers = [a for a in client.answers if a[1] <= seen]
                ask_responses(http, client, step, previous=response_id)
            check_responses(http, client)
        except AssertionError as failure:
            raise AssertionError(f"after {steps}: {failure}") from failure
