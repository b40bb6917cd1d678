"""Alembic environment: migrations run on a connection handed over by `memory.db.migrate`."""

from alembic import context
from sqlalchemy.engine import Connection

from memory.schema import metadata

connection: Connection | None = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `memstrata migrate` (it supplies the connection)")

context.configure(connection=connection, target_metadata=metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
