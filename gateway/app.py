"""The application factory: `create_app(settings)` builds the FastAPI app and its lifespan.

The lifespan owns every resource of the process: the embedded Postgres when no
`MEMSTRATA_DATABASE_URL` is set (started, and stopped on exit if this process started it), the
database engine (checked for pgvector and migrated at start), the pooled upstream clients, and
the background workers (a child process by default: `gateway.worker_process`). Routes reach
them through `gateway.deps`.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI

from gateway import background, mcp, ui, worker_process
from gateway.errors import install_handlers
from gateway.key_grace import KeyGrace
from gateway.logs import RequestIdMiddleware
from gateway.metrics import Metrics, MetricsMiddleware
from gateway.openai import response_upstream
from gateway.routes import admin, health, metrics, openai
from gateway.settings import Settings
from gateway.state import State
from gateway.upstream import Upstream, make_clients
from memory import tokens
from memory.db import connect, migrate, transaction
from memory.embeddings import LocalEmbedder
from memory.errors import ProviderError
from memory.postgres import EmbeddedPostgres
from memory.write import store

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; `settings` default to the environment's."""
    settings = settings or Settings()
    app_metrics = Metrics(refresh_seconds=settings.metrics_refresh_seconds)
    mcp_endpoint = mcp.McpEndpoint()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, State]]:
        async with AsyncExitStack() as stack:
            url = settings.database_url
            if url is None:
                embedded = EmbeddedPostgres(settings.data_dir)
                await asyncio.to_thread(embedded.start)
                stack.push_async_callback(asyncio.to_thread, embedded.stop_if_started)
                url = embedded.url
            engine = connect(url, pool_size=settings.db_pool_size)
            stack.push_async_callback(engine.dispose)
            clients = make_clients(
                timeout=settings.upstream_timeout,
                connect_timeout=settings.upstream_connect_timeout,
                keep_alive=settings.upstream_keep_alive_seconds,
            )
            for one in clients:
                stack.push_async_callback(one.aclose)
            upstream_api = background.provider(settings)
            stack.push_async_callback(upstream_api.aclose)
            # Load the tokenizers now rather than on the first request.
            await asyncio.to_thread(tokens.load_encodings)
            await migrate(engine)
            async with transaction(engine) as conn:
                default_tenant = await store.tenant_id_by_name(conn)
            embed = background.embedder(settings, upstream_api)
            # The local model loads on first use: without this the first request of every
            # process waited for it (0.3 s here; 4 s the first time ever, when its int8 copy is
            # converted), after the process had said it was ready.
            if isinstance(embed, LocalEmbedder):
                try:
                    await embed.warmup()
                except ProviderError as exc:
                    log.error("the local embedding model did not load: %s", exc)
            if settings.workers > 0 and settings.worker_process == "on":
                await stack.enter_async_context(
                    worker_process.running(settings, url, observe=app_metrics.observe_job)
                )
            elif settings.workers > 0:
                config = background.tree_config(settings, upstream_api, embed)
                runner = background.worker(
                    engine,
                    settings,
                    config,
                    concurrency=settings.workers,
                    observe=app_metrics.observe_job,
                )
                await stack.enter_async_context(background.running(runner))
            state = State(
                settings=settings,
                engine=engine,
                upstream=Upstream(
                    clients,
                    base_url=settings.upstream_url,
                    api_key=settings.upstream_api_key,
                    forward_client_auth=settings.auth == "off",
                    observe=app_metrics.observe_upstream,
                    serves_responses=response_upstream.serves_responses(settings),
                ),
                embedder=embed,
                default_tenant_id=default_tenant,
                metrics=app_metrics,
                key_grace=KeyGrace(
                    seconds=settings.key_grace_seconds if settings.fail_open == "on" else 0
                ),
            )
            if settings.auth == "on" and not settings.upstream_api_key:
                log.warning(
                    "MEMSTRATA_AUTH is on and MEMSTRATA_UPSTREAM_API_KEY is unset: "
                    "requests go upstream without a key"
                )
            await stack.enter_async_context(mcp_endpoint.running())
            log.info("memstrata ready", extra={"upstream": settings.upstream_url})
            stack.push_async_callback(state.close)
            yield {"memstrata": state}

    app = FastAPI(
        title="memstrata",
        summary="OpenAI-compatible gateway with unbounded, lossless, hierarchical memory",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_handlers(app)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(mcp_endpoint.router)
    app.include_router(ui.router)
    # Added last is outermost: every request gets its id before it is counted.
    app.add_middleware(MetricsMiddleware, metrics=app_metrics, routes=app.router)
    app.add_middleware(RequestIdMiddleware)
    return app
