"""Property-based: whatever schemathesis sends to the admin API, it never answers 5xx.

The schema is the app's own OpenAPI document, narrowed to `/admin` (built from `create_app`
at collection time, which does no I/O; a test checks that the running server serves the same
one), and every case goes to a real `memstrata serve` process with an admin token. schemathesis
generates valid and invalid requests for every operation (bounded, so the run stays well under
a minute) and checks only that no answer is a server error. Tenants, conversations and keys it
creates live in the session's throwaway database.

(`schemathesis.pytest.from_fixture`, which would load the served schema lazily, does not work
with pytest 9: it sets `Function._nodeid`, which pytest no longer has.)
"""

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.app import create_app
from gateway.settings import Settings

TOKEN = f"schemathesis-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, workers=0, admin_token=TOKEN
    ) as process:
        # The conversation the schema's examples name, so that reads also succeed.
        seeded = httpx.post(
            f"{process.root_url}/admin/conversations/chat-42/messages",
            json={"messages": [{"role": "user", "content": "Seeded for schemathesis."}]},
            headers=AUTH,
            timeout=30,
        )
        assert seeded.status_code == 201, seeded.text
        yield process


OPENAPI = create_app(Settings(database_url="postgresql://unused@127.0.0.1:1/unused")).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI).include(path_regex="^/admin")


def test_the_server_serves_this_schema(gateway: GatewayProcess) -> None:
    served = httpx.get(f"{gateway.root_url}/openapi.json", timeout=10).json()
    assert served == OPENAPI
    assert sum(path.startswith("/admin") for path in served["paths"]) >= 15


@schema.parametrize()
@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_admin_api_never_answers_5xx(case: Any, gateway: GatewayProcess) -> None:
    case.call_and_validate(
        base_url=gateway.root_url, headers=AUTH, checks=[not_a_server_error], timeout=30
    )
