"""The fake upstream's files and batches: objects an account keeps, for the relay's tests.

One in-memory account, as an upstream behind one API key is: every caller sees every object.

* ``POST /v1/files`` (multipart ``file`` + ``purpose``) -- a ``file`` object, ``id``
  ``file-<hex>``; ``GET /v1/files[?purpose&limit&after&order]`` -- a cursor page
  (``object: list``, ``data``, ``first_id``, ``last_id``, ``has_more``), oldest first unless
  ``order=desc``, ``limit`` 10,000 by default; ``GET /v1/files/{id}``; ``GET
  /v1/files/{id}/content`` -- the bytes uploaded; ``DELETE /v1/files/{id}``.
* ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window``) -- a batch
  that is ``completed`` at once, its ``output_file_id`` a new file (one JSON line per input
  line, each an echo); ``GET /v1/batches[?limit&after]`` (limit 20 by default); ``GET
  /v1/batches/{id}``; ``POST /v1/batches/{id}/cancel``.
* An unknown id answers 404 ``No such File object: <id>`` (or ``Batch``), in OpenAI's shape.
"""

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from devkit.upstream_script import error_body

Record = Callable[[Request], Awaitable[object]]


def _page(objects: list[dict[str, Any]], request: Request, *, limit: int) -> JSONResponse:
    query = request.query_params
    listed = objects[::-1] if query.get("order") == "desc" else objects
    if "purpose" in query:
        listed = [o for o in listed if o.get("purpose") == query["purpose"]]
    if after := query.get("after"):
        ids = [o["id"] for o in listed]
        listed = listed[ids.index(after) + 1 :] if after in ids else []
    size = int(query.get("limit", limit))
    data = listed[:size]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(listed) > size,
        }
    )


def _missing(kind: str, object_id: str) -> JSONResponse:
    return JSONResponse(error_body(f"No such {kind} object: {object_id}", status=404), 404)


def files_routes(record: Record) -> list[Route]:
    """The routes of one account's files and batches; `record` logs each request first."""
    files: dict[str, dict[str, Any]] = {}
    contents: dict[str, bytes] = {}
    batches: dict[str, dict[str, Any]] = {}

    def add_file(name: str, purpose: str, content: bytes) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        files[file_id] = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": name,
            "purpose": purpose,
            "status": "processed",
        }
        contents[file_id] = content
        return files[file_id]

    async def collection(request: Request) -> Response:
        await record(request)
        if request.method == "GET":
            return _page(list(files.values()), request, limit=10_000)
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            return JSONResponse(error_body("'file' is a required property", status=400), 400)
        return JSONResponse(
            add_file(upload.filename or "upload", str(form.get("purpose", "")), await upload.read())
        )

    async def one_file(request: Request) -> Response:
        await record(request)
        file_id = request.path_params["file_id"]
        if file_id not in files:
            return _missing("File", file_id)
        if request.method == "DELETE":
            del files[file_id], contents[file_id]
            return JSONResponse({"id": file_id, "object": "file", "deleted": True})
        return JSONResponse(files[file_id])

    async def content(request: Request) -> Response:
        await record(request)
        file_id = request.path_params["file_id"]
        if file_id not in files:
            return _missing("File", file_id)
        return Response(contents[file_id], media_type="application/octet-stream")

    async def batch_collection(request: Request) -> Response:
        await record(request)
        if request.method == "GET":
            return _page(list(batches.values()), request, limit=20)
        body = await request.json()
        input_id = body.get("input_file_id", "")
        if input_id not in files:
            return _missing("File", input_id)
        lines = contents[input_id].decode().splitlines()
        echoed = "".join(json.dumps({"echo": json.loads(line)}) + "\n" for line in lines)
        output = add_file(f"{input_id}_output.jsonl", "batch_output", echoed.encode())
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        batches[batch_id] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body.get("endpoint"),
            "input_file_id": input_id,
            "completion_window": body.get("completion_window"),
            "status": "completed",
            "output_file_id": output["id"],
            "error_file_id": None,
            "created_at": int(time.time()),
            "request_counts": {"total": len(lines), "completed": len(lines), "failed": 0},
            "metadata": body.get("metadata"),
        }
        return JSONResponse(batches[batch_id])

    async def one_batch(request: Request) -> Response:
        await record(request)
        batch_id = request.path_params["batch_id"]
        if batch_id not in batches:
            return _missing("Batch", batch_id)
        if request.url.path.endswith("/cancel"):
            batches[batch_id]["status"] = "cancelled"
        return JSONResponse(batches[batch_id])

    return [
        Route("/v1/files", collection, methods=["GET", "POST"]),
        Route("/v1/files/{file_id}", one_file, methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", content, methods=["GET"]),
        Route("/v1/batches", batch_collection, methods=["GET", "POST"]),
        Route("/v1/batches/{batch_id}", one_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", one_batch, methods=["POST"]),
    ]
