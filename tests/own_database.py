"""The `database_url` and `engine` of a test module's own database, for modules whose workers
run every queued job (see `conftest.module_database_url`): such a module imports both, which
override the session's."""

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine


@pytest.fixture(scope="module")
def database_url(module_database_url: str) -> str:
    return module_database_url


@pytest.fixture(scope="module")
def engine(module_engine: AsyncEngine) -> AsyncEngine:
    return module_engine
