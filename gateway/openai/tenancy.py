"""Keeping the upstream's objects to the tenant that made them, while `MEMSTRATA_AUTH` is on.

Every tenant's requests reach the upstream with one key (`MEMSTRATA_UPSTREAM_API_KEY`), so to
the upstream its files, batches and vector stores are one account's. The gateway keeps them
apart (`memory.write.upstream_objects` records who made what):

* **Owned collections** (`OWNED`: files, uploads, batches, vector stores, fine-tuning jobs,
  containers, evals, conversations). Creating one (`POST /v1/files`) makes the new object the
  tenant's. `/v1/{collection}/{id}/…` reaches an object, and what lies under it, only for the
  tenant that owns it: another's, or one made outside the gateway, is 404, the same answer as
  an id that does not exist, so nobody learns which ids are in use. Listing a collection shows
  the tenant's own objects only, paging on through the upstream to fill the page asked for.
* **References in a body.** A JSON body (relayed, or a chat completion's or a response's) may
  name objects (`file_id`, `file_ids`, `input_file_id`, `training_file`, `vector_store_ids`,
  `container`, …, see `_REFERENCES`): each must be the tenant's, else 404 naming the field,
  before anything is stored or sent.
* **An object made but not recorded** (the database failed after the upstream created it) is
  deleted upstream before the client gets the error, where its collection deletes by id.
* **Objects the upstream makes for a tenant** (a batch's `output_file_id` and
  `error_file_id`, a fine-tuning job's `result_files`, the file a completed upload becomes)
  are the tenant's once an answer to it names them.
* **Open paths** (`MEMSTRATA_RELAY_OPEN_PATHS`: models, moderations, audio, images, …) hold no
  tenant's objects and are relayed to every tenant, for reading and creating (GET, POST) only:
  a DELETE there (a fine-tuned model's) would act on the account.
* **Any other path** gets 403 `path_not_relayed`: the gateway cannot tell whose its objects are
  (stored chat completions, for instance, are the account's, not a tenant's).

With authentication off, one tenant owns everything, and the relay passes every path on
unchanged (`gateway.openai.passthrough`). Objects a tenant made before this check existed have
no owner and stay out of every tenant's reach.
"""

import json
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, quote, urlencode

import httpx
from fastapi import Request
from fastapi.responses import Response

from gateway.bodies import read_bytes
from gateway.errors import GatewayError
from gateway.openai import passthrough
from gateway.state import State
from gateway.upstream import relayed_headers
from memory.db import transaction
from memory.write import upstream_objects

OWNED: Final = (
    "files",
    "uploads",
    "batches",
    "vector_stores",
    "fine_tuning/jobs",
    "containers",
    "evals",
    "conversations",
)
"""The collections whose objects belong to the tenant that created them."""

log = logging.getLogger(__name__)

# Body fields that name an upstream object (a string, or a list of them).
_REFERENCES: Final = frozenset(
    {
        "file_id",
        "file_ids",
        "input_file_id",
        "training_file",
        "validation_file",
        "vector_store_id",
        "vector_store_ids",
        "container",
        "conversation",
    }
)
# Answer fields naming an object the upstream made for the tenant's own object.
_PRODUCED: Final = frozenset({"output_file_id", "error_file_id", "result_files"})
# Never references: a client's own key-value pairs, and the citations of an answer resent
# (they may name a container's files, which no request created).
_UNCHECKED: Final = frozenset({"metadata", "annotations"})
_OPEN_METHODS: Final = frozenset({"GET", "HEAD", "POST"})
# The owned collections whose objects are deleted by `DELETE /v1/{collection}/{id}` (batches,
# uploads and fine-tuning jobs are cancelled instead, and kept).
_DELETABLE: Final = frozenset({"files", "vector_stores", "containers", "evals", "conversations"})
# How many upstream pages a listing reads, at most, to fill one page of the tenant's objects.
_MAX_PAGES: Final = 20


@dataclass(frozen=True)
class Target:
    """Where a relayed path points in an owned collection: the collection itself
    (`object_id` None), or one object and what lies under it (`rest`)."""

    collection: str
    object_id: str | None
    rest: tuple[str, ...]


def target(path: str) -> Target | None:
    """The owned collection `path` (relative to `/v1`) lies in, if any."""
    parts = [part for part in path.split("/") if part]
    for collection in OWNED:
        prefix = collection.split("/")
        if parts[: len(prefix)] == prefix:
            rest = parts[len(prefix) :]
            return Target(collection, rest[0] if rest else None, tuple(rest[1:]))
    return None


def is_open(path: str, open_paths: Collection[str]) -> bool:
    """Whether `path` lies under one of `open_paths` (whole segments: `audio` opens
    `audio/speech`, not `audiobooks`)."""
    parts = [part for part in path.split("/") if part]
    return any(parts[: len(p)] == p for p in (o.strip("/").split("/") for o in open_paths))


def references(body: Any) -> dict[str, str]:
    """The upstream objects a JSON body names, each with the field that names it."""
    return {ref: field for field, ref in _named(body, _REFERENCES)}


def produced(answer: Any) -> set[str]:
    """The objects an answer names that the upstream made for the object asked about."""
    found = {ref for _, ref in _named(answer, _PRODUCED)}
    return found | {
        value["id"]
        for value in _dicts(answer)
        if value.get("object") == "file" and isinstance(value.get("id"), str)
    }


async def check_references(state: State, *, tenant_id: int, body: Any) -> None:
    """404 (naming the field) unless every object `body` names is the tenant's; nothing to
    check while authentication is off."""
    if state.settings.auth == "on" and (named := references(body)):
        await _require(state, tenant_id=tenant_id, ids=named)


async def relay(request: Request, state: State, *, tenant_id: int, path: str) -> Response:
    """Relay a request for `/v1/{path}` as the tenant may see it (the module's docstring)."""
    if state.settings.auth == "off":
        return await passthrough.relay(request, state.upstream, f"/{path}", observed_as="/*")
    where = target(path)
    if where is None:
        if request.method in _OPEN_METHODS and is_open(path, state.settings.relay_open_paths):
            return await passthrough.relay(request, state.upstream, f"/{path}", observed_as="/*")
        raise GatewayError(
            403,
            f"{request.method} /v1/{path} is not relayed while MEMSTRATA_AUTH is on: what it "
            "reaches is the upstream account's, shared by every tenant "
            "(MEMSTRATA_RELAY_OPEN_PATHS lists the paths relayed to every tenant)",
            code="path_not_relayed",
        )
    content = await _json_body(request, state)
    named = references(_loads(content)) if content is not None else {}
    if where.object_id is not None:
        named[where.object_id] = "path"
    await _require(state, tenant_id=tenant_id, ids=named)
    if where.object_id is None and request.method == "GET":
        return await _listing(request, state, tenant_id=tenant_id, path=path)
    response = await passthrough.send(
        request, state.upstream, f"/{path}", content=content, observed_as="/*"
    )
    json_answer = response.headers.get("content-type", "").startswith("application/json")
    if not (response.is_success and json_answer and where.rest[-1:] != ("content",)):
        return passthrough.answer(response)
    raw = await state.upstream.read(response)
    answer = _loads(raw)
    made = produced(answer)
    if where.object_id is None and isinstance(answer, dict) and isinstance(answer.get("id"), str):
        made.add(answer["id"])
    made.discard(where.object_id)  # owned already: reading a file wrote nothing
    if made:
        try:
            async with transaction(state.engine) as conn:
                await upstream_objects.adopt(conn, tenant_id=tenant_id, object_ids=made)
        except Exception:
            if where.object_id is None and request.method == "POST":
                created = answer.get("id") if isinstance(answer, dict) else None
                await _unmake(request, state, where.collection, created)
            raise
    return Response(raw, response.status_code, headers=_without_length(response))


async def _unmake(request: Request, state: State, collection: str, object_id: Any) -> None:
    """Delete upstream the object a request created when it could not be recorded as the
    tenant's: the client is told the request failed, and an object no tenant owns would stay
    out of every tenant's reach (and on the account's bill) for good."""
    if not isinstance(object_id, str):
        return
    if collection in _DELETABLE:
        upstream = state.upstream
        try:
            answer = await upstream.open(
                "DELETE",
                f"/{collection}/{quote(object_id, safe='')}",
                headers=upstream.headers_for(request.headers),
                observed_as="/*",
            )
            await upstream.read(answer)
            if answer.is_success or answer.status_code == 404:
                log.warning("deleted %s upstream: it could not be recorded as made", object_id)
                return
        except GatewayError:
            pass
    log.error(
        "%s was created upstream but could not be recorded as its tenant's, nor deleted: "
        "no tenant can reach it; delete it with the upstream's own key",
        object_id,
    )


async def _require(state: State, *, tenant_id: int, ids: dict[str, str]) -> None:
    if not ids:
        return
    async with transaction(state.engine) as conn:
        mine = await upstream_objects.owned(conn, tenant_id=tenant_id, object_ids=ids)
    for object_id, field in ids.items():
        if object_id not in mine:
            raise GatewayError(
                404,
                f"No such object of this tenant: {object_id}",
                param=None if field == "path" else field,
                code="object_not_found",
            )


async def _listing(request: Request, state: State, *, tenant_id: int, path: str) -> Response:
    """A page of the tenant's own objects: upstream pages are read on (`after` the last id
    seen) until `limit` of them are found or the upstream has no more."""
    query = dict(parse_qsl(request.url.query, keep_blank_values=True))
    wanted = int(query["limit"]) if query.get("limit", "").isdigit() else None
    kept: list[Any] = []
    for _ in range(_MAX_PAGES):
        response = await passthrough.send(
            request, state.upstream, f"/{path}", query=urlencode(query), observed_as="/*"
        )
        if not response.is_success:
            return passthrough.answer(response)
        page = _loads(await state.upstream.read(response))
        data = page.get("data") if isinstance(page, dict) else None
        if not isinstance(data, list):
            raise GatewayError(502, "the upstream's list has no `data`", type="api_error")
        ids = {item["id"] for item in data if isinstance(item, dict) and "id" in item}
        async with transaction(state.engine) as conn:
            mine = await upstream_objects.owned(conn, tenant_id=tenant_id, object_ids=ids)
        for item in data:
            if isinstance(item, dict) and item.get("id") in mine:
                kept.append(item)
        last = data[-1].get("id") if data and isinstance(data[-1], dict) else None
        more = bool(page.get("has_more")) and isinstance(last, str)
        if not more or (wanted is not None and len(kept) >= wanted):
            break
        query["after"] = str(last)
    shown = kept[:wanted] if wanted is not None else kept
    listed = {
        **page,
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": more or len(kept) > len(shown),
    }
    return Response(
        json.dumps(listed),
        response.status_code,
        headers=_without_length(response),
        media_type="application/json",
    )


async def _json_body(request: Request, state: State) -> bytes | None:
    """A JSON body, read whole so that the objects it names can be checked (others, such as
    an upload's multipart one, stream through unread)."""
    if not request.headers.get("content-type", "").startswith("application/json"):
        return None
    return await read_bytes(request, max_bytes=state.settings.max_body_bytes)


def _named(value: Any, fields: frozenset[str]) -> Iterator[tuple[str, str]]:
    """(field, id) for every string, or string in a list, under one of `fields`."""
    for node in _dicts(value):
        if fields.isdisjoint(node):
            continue
        for field in fields.intersection(node):
            named = node[field]
            if isinstance(named, str):
                yield field, named
            elif isinstance(named, dict) and isinstance(named.get("id"), str):
                yield field, named["id"]
            elif isinstance(named, list):
                yield from ((field, item) for item in named if isinstance(item, str))


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    """Every object in a JSON value, depth first, except those `_UNCHECKED`."""
    # Exact types and no nested generators: a 10,000-message body is walked in ~4 ms.
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            yield node
            for field, item in node.items():
                if (type(item) is dict or type(item) is list) and field not in _UNCHECKED:
                    stack.append(item)
        elif type(node) is list:
            for item in node:
                if type(item) is dict or type(item) is list:
                    stack.append(item)


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _without_length(response: httpx.Response) -> dict[str, str]:
    # The body is re-sent (a listing filtered): its own length is the one to announce.
    return {k: v for k, v in relayed_headers(response).items() if k.lower() != "content-length"}
