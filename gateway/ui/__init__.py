"""The memory browser (`/ui`): a web page to see, search and open every conversation's memory.

The page is the project's own HTML, CSS and JavaScript (`gateway/ui/static/`, shipped in the
wheel as package data): no build step, nothing loaded from elsewhere at run time, which the
`Content-Security-Policy` of every answer enforces in the browser (`'self'` only). The scripts
call the admin API (`/admin`) with `Authorization: Bearer <admin token>`, the token entered
once and kept in the browser's `sessionStorage` (gone with the tab), and `?tenant=` for the
tenant picked.

The guard is the admin API's (`gateway.auth.check_admin`): while no admin token is set, the page
and its files answer only what the admin API answers (loopback clients), and refuse others with
the same 403. With a token set, the page and its files are served to anyone: they hold no data,
and a browser cannot send a bearer token when it loads a page; everything they show comes from
the admin API, which refuses a request without the token.
"""

import re
from importlib import resources
from typing import Final

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse, Response

from gateway import auth
from gateway.deps import StateDep
from gateway.errors import GatewayError

STATIC: Final = resources.files(__package__) / "static"
MEDIA_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
_NAME = re.compile(r"^[a-z][a-z0-9_-]*\.(html|css|js|svg)$")
HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def require_ui(request: Request, state: StateDep) -> None:
    """The admin API's guard while no admin token is set; nothing to guard once one is."""
    if state.settings.admin_token is None:
        auth.check_admin(state, request)


router = APIRouter(prefix="/ui", include_in_schema=False, dependencies=[Depends(require_ui)])


@router.api_route("", methods=["GET", "HEAD"])
async def bare() -> RedirectResponse:
    """`/ui` → `/ui/`, so that the page's relative links resolve under `/ui/`."""
    return RedirectResponse("ui/", status_code=308)


@router.api_route("/", methods=["GET", "HEAD"])
async def page() -> Response:
    """The page: its scripts draw every view (conversations, one conversation, jobs, tenants)."""
    return _file("index.html")


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
async def static(name: str) -> Response:
    """One of the page's own files."""
    return _file(name)


def _file(name: str) -> Response:
    found = STATIC / name
    if not _NAME.match(name) or not found.is_file():
        raise GatewayError(404, f"the memory browser has no file {name!r}", code="not_found")
    suffix = name[name.rindex(".") :]
    return Response(found.read_bytes(), media_type=MEDIA_TYPES[suffix], headers=HEADERS)
