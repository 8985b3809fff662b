"""host capacity table (maintained by triggers) and keyset paging indexes

Placement used to read every host (decoding its JSON GPU list) and every row of gpu_assignments on
each create, so its cost grew with the number of allocations. `host_capacity` keeps, per host and GPU
model, the model's GPU indices, their count and how many are assigned. Triggers keep it exact in the
same transaction as the change:

- on gpu_assignments (insert/delete/update): `used` of the row whose `indices` hold the GPU index is
  incremented/decremented (an UPDATE ... SET used = used + 1 re-reads the latest row version, so
  concurrent assignment changes on one host compose; no stale recount);
- on hosts (insert, update of gpus): the host's rows are rebuilt from its GPU list, after locking its
  existing rows so that a concurrent decrement commits first and is seen by the recount.

Placement reads the candidate hosts from this table (a few hundred rows at most, whatever the number
of allocations), then locks the chosen host row and re-reads that one host's assignments before
inserting, so the table only steers the choice: the host row lock and gpu_assignments' primary key
still make double-booking impossible.

Revision ID: allocations_0005
Revises: allocations_0004
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "allocations_0005"
down_revision: str | Sequence[str] | None = "allocations_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTIONS = """
CREATE FUNCTION host_capacity_rebuild(p_host_id uuid) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    -- Lock the host's rows first: a concurrent assignment change on them commits before the recount,
    -- which (a new statement, a new snapshot) then sees it; later changes wait for this transaction.
    PERFORM 1 FROM host_capacity WHERE host_id = p_host_id FOR UPDATE;
    DELETE FROM host_capacity c WHERE c.host_id = p_host_id AND c.gpu_model NOT IN (
        SELECT g->>'model' FROM hosts h, jsonb_array_elements(h.gpus) g WHERE h.host_id = p_host_id);
    INSERT INTO host_capacity (host_id, gpu_model, indices, total, used)
    SELECT p_host_id, inv.model, inv.indices, cardinality(inv.indices),
           (SELECT count(*) FROM gpu_assignments a WHERE a.host_id = p_host_id AND a.gpu_index = ANY(inv.indices))
    FROM (
        SELECT g->>'model' AS model, array_agg(DISTINCT (g->>'index')::int ORDER BY (g->>'index')::int) AS indices
        FROM hosts h, jsonb_array_elements(h.gpus) g
        WHERE h.host_id = p_host_id
        GROUP BY g->>'model'
    ) inv
    ON CONFLICT (host_id, gpu_model) DO UPDATE
        SET indices = EXCLUDED.indices, total = EXCLUDED.total, used = EXCLUDED.used;
END $$;
--
CREATE FUNCTION host_capacity_on_host() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM host_capacity_rebuild(NEW.host_id);
    RETURN NULL;
END $$;
--
CREATE FUNCTION host_capacity_on_assignment() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        UPDATE host_capacity SET used = used - 1 WHERE host_id = OLD.host_id AND OLD.gpu_index = ANY(indices);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        UPDATE host_capacity SET used = used + 1 WHERE host_id = NEW.host_id AND NEW.gpu_index = ANY(indices);
    END IF;
    RETURN NULL;
END $$;
--
CREATE TRIGGER host_capacity_host AFTER INSERT OR UPDATE OF gpus ON hosts
    FOR EACH ROW EXECUTE FUNCTION host_capacity_on_host();
--
CREATE TRIGGER host_capacity_assignment AFTER INSERT OR DELETE OR UPDATE OF host_id, gpu_index ON gpu_assignments
    FOR EACH ROW EXECUTE FUNCTION host_capacity_on_assignment();
"""


def upgrade() -> None:
    op.create_table(
        "host_capacity",
        sa.Column("host_id", sa.UUID(), nullable=False),
        sa.Column("gpu_model", sa.Text(), nullable=False),
        sa.Column("indices", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.host_id"], name=op.f("fk_host_capacity_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("host_id", "gpu_model", name=op.f("pk_host_capacity")),
    )
    op.create_index("ix_host_capacity_model_free", "host_capacity", ["gpu_model", sa.literal_column("(total - used)")])
    for statement in _FUNCTIONS.split("\n--\n"):  # asyncpg runs one statement per call
        op.execute(statement)
    op.execute("SELECT host_capacity_rebuild(host_id) FROM hosts")
    # Keyset paging: newest first with the id as tie-break, per project or across projects.
    op.drop_index("ix_allocations_project_requested", table_name="allocations")
    op.drop_index("ix_allocations_requested", table_name="allocations")
    op.create_index(
        "ix_allocations_project_requested",
        "allocations",
        ["project_id", sa.literal_column("requested_at DESC"), sa.literal_column("allocation_id DESC")],
    )
    op.create_index(
        "ix_allocations_requested",
        "allocations",
        [sa.literal_column("requested_at DESC"), sa.literal_column("allocation_id DESC")],
    )


def downgrade() -> None:
    op.drop_index("ix_allocations_requested", table_name="allocations")
    op.drop_index("ix_allocations_project_requested", table_name="allocations")
    op.create_index(
        "ix_allocations_project_requested", "allocations", ["project_id", sa.literal_column("requested_at DESC")]
    )
    op.create_index("ix_allocations_requested", "allocations", [sa.literal_column("requested_at DESC")])
    op.execute("DROP TRIGGER host_capacity_assignment ON gpu_assignments")
    op.execute("DROP TRIGGER host_capacity_host ON hosts")
    op.execute("DROP FUNCTION host_capacity_on_assignment()")
    op.execute("DROP FUNCTION host_capacity_on_host()")
    op.execute("DROP FUNCTION host_capacity_rebuild(uuid)")
    op.drop_index("ix_host_capacity_model_free", table_name="host_capacity")
    op.drop_table("host_capacity")
