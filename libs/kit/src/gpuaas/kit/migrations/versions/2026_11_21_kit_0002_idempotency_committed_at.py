"""idempotency_keys.committed_at: set in the transaction of the request's own writes.

A reservation with `committed_at` but no response belongs to a request whose effect committed while its
response died with the process: a retry must not run it again.

Revision ID: kit_0002
Revises: kit_0001
Create Date: 2026-11-21
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "kit_0002"
down_revision: str | Sequence[str] | None = "kit_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("idempotency_keys", "committed_at")
