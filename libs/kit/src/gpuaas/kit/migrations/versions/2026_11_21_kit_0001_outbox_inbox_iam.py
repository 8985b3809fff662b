"""kit tables: outbox (+ NOTIFY trigger), inbox, dead letters, idempotency keys, IAM projection.

Revision ID: kit_0001
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

from alembic import op

from gpuaas.kit.tables import kit_metadata

revision: str = "kit_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("kit",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    kit_metadata.create_all(bind)  # frozen copy of the kit tables at this revision
    # One NOTIFY per inserting statement wakes the relay; polling covers a missed notification.
    op.execute(
        """
        CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          PERFORM pg_notify(TG_TABLE_SCHEMA || '_outbox', '');
          RETURN NULL;
        END $$;
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS outbox_notify ON outbox")
    op.execute("DROP FUNCTION IF EXISTS outbox_notify()")
    kit_metadata.drop_all(op.get_bind())
