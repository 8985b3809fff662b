"""IAM projection ordered by the producer's per-record sequence, not event time (issue 17, defect 8).

`event_sequence` numbers the events a service's outbox stamps (identity's, for its topic); the projection
tables keep the `version` (envelope `sequence`) of the state they hold.

Revision ID: kit_0003
Revises: kit_0002
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "kit_0003"
down_revision: str | Sequence[str] | None = "kit_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("iam_tenants", "iam_projects", "iam_users", "iam_memberships", "iam_service_accounts")


def upgrade() -> None:
    op.execute("CREATE SEQUENCE IF NOT EXISTS event_sequence")
    for table in TABLES:
        op.add_column(table, sa.Column("version", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "version")
    op.execute("DROP SEQUENCE IF EXISTS event_sequence")
