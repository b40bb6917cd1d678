"""Liveness and readiness probes."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import EngineDep
from memory.db import ping
from memory.errors import StorageUnavailable

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The database is reachable")
async def readyz(engine: EngineDep) -> JSONResponse:
    try:
        await ping(engine)
    except StorageUnavailable as exc:
        return JSONResponse({"status": "unavailable", "database": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok"})
