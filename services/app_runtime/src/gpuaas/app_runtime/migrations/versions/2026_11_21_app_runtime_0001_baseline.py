"""app_runtime: baseline (the service's own tables start here; kit tables come from the `kit` branch).

Revision ID: app_runtime_0001
Revises:
Create Date: 2026-11-21
"""

from collections.abc import Sequence

revision: str = "app_runtime_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("app_runtime",)
depends_on: str | Sequence[str] | None = "kit_0001"


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
