"""`GET /metrics`: the app's Prometheus metrics (`gateway.metrics`), for operators only.

Readable with `MEMSTRATA_METRICS_TOKEN`, or as an admin request (`gateway.auth.check_metrics`).
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import check_metrics
from gateway.deps import StateDep
from gateway.metrics import CONTENT_TYPE

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}},
)
async def scrape(request: Request, state: StateDep) -> Response:
    """The metrics in Prometheus' text format (`gateway.auth.check_metrics` guards them)."""
    check_metrics(state, request)
    await state.metrics.refresh(state.engine)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
