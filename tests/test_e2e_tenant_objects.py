"""End to end: with auth on, each tenant reaches only the upstream objects it made.

A real `memstrata serve` with `MEMSTRATA_AUTH=on` in front of the fake upstream process, whose
files and batches are one account's (`devkit/upstream_files.py`), as a real upstream behind one
API key is. Two tenants drive it with the official OpenAI SDK: each uploads files and runs a
batch; the other can neither list, read, download, delete nor reference them (in a batch, a
chat completion's file part, a response's `input_file`), and gets the answer an unknown id gets.
A batch's output file is its owner's. Listing pages on through the upstream to fill the page
asked for. Paths that hold the account's objects but no tenant's are refused; open ones
(models, moderations) are relayed to every tenant.
"""

import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import FilePurpose
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory import schema

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex

pytestmark = pytest.mark.usefixtures("fresh_upstream")


@dataclass
class Tenant:
    name: str
    sdk: OpenAI


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        auth="on",
        admin_token=ADMIN_TOKEN,
        upstream_api_key="sk-upstream-" + uuid.uuid4().hex,
        memory_tools="never",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def tenants(gateway: GatewayProcess) -> Iterator[tuple[Tenant, Tenant]]:
    made = []
    with httpx.Client(
        base_url=f"{gateway.root_url}/admin",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    ) as admin:
        for _ in range(2):
            name = f"obj-{uuid.uuid4().hex[:10]}"
            assert admin.post("/tenants", json={"name": name}).status_code == 201
            key = admin.post(f"/tenants/{name}/keys", json={"name": "app"}).json()["key"]
            made.append(Tenant(name, OpenAI(base_url=gateway.url, api_key=key, max_retries=0)))
        yield made[0], made[1]
        for tenant in made:
            tenant.sdk.close()
            assert admin.delete(f"/tenants/{tenant.name}").status_code == 200


def upload(tenant: Tenant, text: str, purpose: FilePurpose = "assistants") -> str:
    made = tenant.sdk.files.create(file=("notes.txt", io.BytesIO(text.encode())), purpose=purpose)
    return made.id


def test_a_tenants_files_are_its_own(tenants: tuple[Tenant, Tenant]) -> None:
    alice, bob = tenants
    secret = f"alice's ledger {uuid.uuid4().hex}"
    mine = upload(alice, secret)
    theirs = upload(bob, "bob's notes")
    assert alice.sdk.files.retrieve(mine).filename == "notes.txt"
    assert alice.sdk.files.content(mine).read() == secret.encode()
    assert mine in {f.id for f in alice.sdk.files.list()}
    listed = {f.id for f in bob.sdk.files.list()}
    assert theirs in listed and mine not in listed
    for attempt in (
        lambda: bob.sdk.files.retrieve(mine),
        lambda: bob.sdk.files.content(mine),
        lambda: bob.sdk.files.delete(mine),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        assert refused.value.code == "object_not_found"
        assert secret not in str(refused.value.body)
    # An id that exists nowhere gets the very same answer: nothing tells them apart.
    with pytest.raises(openai.NotFoundError) as unknown:
        bob.sdk.files.retrieve("file-" + uuid.uuid4().hex[:24])
    assert unknown.value.code == "object_not_found"
    assert alice.sdk.files.content(mine).read() == secret.encode()  # not deleted by bob
    assert alice.sdk.files.delete(mine).deleted


def test_a_batch_and_its_output_are_its_owners(tenants: tuple[Tenant, Tenant]) -> None:
    alice, bob = tenants
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}
    requests = upload(alice, json.dumps(line) + "\n", purpose="batch")
    with pytest.raises(openai.NotFoundError) as refused:
        bob.sdk.batches.create(
            input_file_id=requests, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert refused.value.param == "input_file_id"
    batch = alice.sdk.batches.create(
        input_file_id=requests, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.output_file_id is not None
    assert json.loads(alice.sdk.files.content(batch.output_file_id).read()) == {"echo": line}
    assert [b.id for b in alice.sdk.batches.list()] == [batch.id]
    assert batch.id not in {b.id for b in bob.sdk.batches.list()}
    with pytest.raises(openai.NotFoundError):
        bob.sdk.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.sdk.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.sdk.files.content(batch.output_file_id)
    assert alice.sdk.batches.retrieve(batch.id).status == "completed"


def test_a_listing_pages_through_the_upstream_to_fill_the_page(
    tenants: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    alice, bob = tenants
    # Interleaved, so that every upstream page of two holds one of each tenant's.
    made: dict[str, list[str]] = {"alice": [], "bob": []}
    for index in range(4):
        made["alice"].append(upload(alice, f"a{index}", purpose="fine-tune"))
        made["bob"].append(upload(bob, f"b{index}", purpose="fine-tune"))
    upstream.reset()
    page = alice.sdk.files.list(purpose="fine-tune", limit=2)
    assert [f.id for f in page.data] == made["alice"][:2]
    assert page.has_more
    listed = upstream.requests()
    assert [r["path"] for r in listed] == ["/v1/files"] * 2  # two upstream pages for one
    # The SDK's own paging goes on from the page's last object, and ends.
    assert [f.id for f in alice.sdk.files.list(purpose="fine-tune", limit=2)] == made["alice"]


def test_references_in_chat_and_responses_must_be_the_tenants(
    gateway: GatewayProcess, tenants: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    alice, bob = tenants
    document = upload(alice, "alice's contract")
    upstream.reset()
    part: ChatCompletionContentPartParam = {"type": "file", "file": {"file_id": document}}
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": [{"type": "text", "text": "read"}, part]}
    ]
    name = f"refs-{uuid.uuid4().hex[:8]}"
    conversation = {"X-Memstrata-Conversation": name}
    with pytest.raises(openai.NotFoundError) as refused:
        bob.sdk.chat.completions.create(
            model="gpt-4o",
            messages=messages,
            extra_headers=conversation,
        )
    assert refused.value.param == "file_id"
    with pytest.raises(openai.NotFoundError):
        bob.sdk.responses.create(
            model="gpt-4o",
            input=[{"role": "user", "content": [{"type": "input_file", "file_id": document}]}],
        )
    assert upstream.requests() == []  # neither went upstream
    stored = httpx.get(
        f"{gateway.root_url}/admin/conversations/{name}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        params={"tenant": bob.name},
    )
    assert stored.status_code == 404  # nothing was stored either
    answer = alice.sdk.chat.completions.create(
        model="gpt-4o",
        messages=messages,
        extra_headers=conversation,
    )
    assert answer.choices[0].message.content == "echo: read"


def test_only_open_paths_are_relayed_to_every_tenant(
    tenants: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    alice, _ = tenants
    assert alice.sdk.models.retrieve("gpt-4o").id == "gpt-4o"
    upstream.script({"path": "/v1/moderations", "body": {"id": "modr-1", "results": []}})
    assert alice.sdk.moderations.create(input="hello").id == "modr-1"
    with pytest.raises(openai.PermissionDeniedError) as stored:
        alice.sdk.chat.completions.list()  # the account's stored completions, every tenant's
    assert stored.value.code == "path_not_relayed"
    with pytest.raises(openai.PermissionDeniedError):
        alice.sdk.models.delete("ft:gpt-4o:acme::abc")  # a DELETE acts on the account
    assert [r["path"] for r in upstream.requests()] == ["/v1/models/gpt-4o", "/v1/moderations"]


def test_a_tenants_responses_are_its_own(tenants: tuple[Tenant, Tenant]) -> None:
    alice, bob = tenants
    made = alice.sdk.responses.create(model="gpt-4o-mini", input=f"alice {uuid.uuid4().hex}")
    for attempt in (
        lambda: bob.sdk.responses.retrieve(made.id),
        lambda: bob.sdk.responses.delete(made.id),
        lambda: bob.sdk.responses.cancel(made.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    # Nor can its reply be resent by reference, as the Vercel AI SDK resends a reply.
    resent: Any = [
        {"type": "item_reference", "id": made.output[0].id},
        {"role": "user", "content": "go on"},
    ]
    with pytest.raises(openai.BadRequestError):
        bob.sdk.responses.create(model="gpt-4o-mini", input=resent)
    assert alice.sdk.responses.create(model="gpt-4o-mini", input=resent).output_text
    assert alice.sdk.responses.retrieve(made.id).output_text == made.output_text
    alice.sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        alice.sdk.responses.retrieve(made.id)


async def test_a_file_made_but_not_recorded_is_deleted_upstream(
    gateway: GatewayProcess, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    """The upstream created the file, then recording it as the tenant's failed (here a trigger
    refuses the tenant's rows): the client gets the error, and the file, which no tenant could
    ever reach, is deleted upstream rather than left on the account."""
    name = f"obj-{uuid.uuid4().hex[:10]}"
    async with httpx.AsyncClient(
        base_url=f"{gateway.root_url}/admin",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    ) as admin:
        assert (await admin.post("/tenants", json={"name": name})).status_code == 201
        made = await admin.post(f"/tenants/{name}/keys", json={"name": "app"})
        key = made.json()["key"]
    async with engine.begin() as conn:
        tenant = await conn.scalar(select(schema.tenants.c.id).where(schema.tenants.c.name == name))
        assert tenant is not None
        await conn.execute(
            text(
                "CREATE FUNCTION refuse_objects() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused'; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse_objects BEFORE INSERT ON upstream_objects FOR EACH ROW "
                f"WHEN (NEW.tenant_id = {int(tenant)}) EXECUTE FUNCTION refuse_objects()"
            )
        )
    try:
        async with openai.AsyncOpenAI(base_url=gateway.url, api_key=key, max_retries=0) as sdk:
            with pytest.raises(openai.APIStatusError) as failed:
                await sdk.files.create(
                    file=("notes.txt", io.BytesIO(b"lost?")), purpose="assistants"
                )
            assert failed.value.status_code >= 500
        deleted = [r["path"] for r in upstream.requests() if r["method"] == "DELETE"]
        assert len(deleted) == 1 and deleted[0].startswith("/v1/files/file-")
        async with httpx.AsyncClient() as direct:
            gone = await direct.get(f"{upstream.url}{deleted[0].removeprefix('/v1')}")
        assert gone.status_code == 404
    finally:
        async with engine.begin() as conn:
            await conn.execute(text("DROP TRIGGER refuse_objects ON upstream_objects"))
            await conn.execute(text("DROP FUNCTION refuse_objects()"))


def test_a_named_conversation_is_each_tenants_own(
    tenants: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    """A stored response's `conversation` names the gateway's conversation of the tenant, not
    an upstream object: any id will do, and the same id is another conversation for another
    tenant (only `store: false`, which goes upstream as sent, must name one of its own)."""
    alice, bob = tenants
    named = f"conv_{uuid.uuid4().hex}"
    secret = f"alice's secret {uuid.uuid4().hex}"
    alice.sdk.responses.create(model="gpt-4o-mini", input=secret, conversation=named)
    raw = bob.sdk.responses.with_raw_response.create(
        model="gpt-4o-mini", input="what was said here?", conversation=named
    )
    assert raw.headers["X-Memstrata-Conversation"] == named
    [alices, bobs] = upstream.requests("/v1/responses")[-2:]
    assert secret in json.dumps(alices["body"]) and secret not in json.dumps(bobs["body"])
    with pytest.raises(openai.NotFoundError):
        bob.sdk.responses.create(model="gpt-4o-mini", input="x", conversation=named, store=False)
