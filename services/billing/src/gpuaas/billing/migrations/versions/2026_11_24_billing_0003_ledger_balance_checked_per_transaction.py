"""ledger balance checked once per database transaction, not per entry row

Revision ID: billing_0003
Revises: billing_0002
Create Date: 2026-11-24 06:45:00.000000

billing_0002 checked the balance with a deferred per-row constraint trigger on ledger_entries: at commit it
ran the balance aggregate once per entry row (twice per charge), i.e. two aggregates per charge for every
consumed usage batch. Constraint triggers can only be row triggers and cannot have transition tables, so
the check now goes in two steps:

1. `ledger_entries_note` (AFTER INSERT, FOR EACH STATEMENT, transition table `new_entries`) adds the ledger
   transaction ids the statement touched to this database transaction's row of `ledger_balance_pending`
   (one row per database transaction, keyed by txid_current(): inserted by the first statement, appended
   to by the next ones);
2. `ledger_balance_pending_check`, a deferred constraint trigger on the insert of that row, fires once at
   commit: it takes the row (and deletes it) and checks every touched ledger transaction in one aggregate,
   raising the same `check_violation` ("ledger transaction … does not balance …") as before.

A savepoint rolled back takes its entries and its part of the pending row with it; the pending table is
UNLOGGED (its rows never outlive their transaction) and always empty between transactions.
"""

import re
from collections.abc import Sequence

from alembic import op

revision: str = "billing_0003"
down_revision: str | Sequence[str] | None = "billing_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


UPGRADE = """
CREATE UNLOGGED TABLE ledger_balance_pending (
    xact bigint PRIMARY KEY,
    transaction_ids uuid[] NOT NULL
);

CREATE FUNCTION ledger_note_entries() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_balance_pending AS p (xact, transaction_ids)
    SELECT txid_current(), array_agg(DISTINCT transaction_id) FROM new_entries HAVING count(*) > 0
    ON CONFLICT (xact) DO UPDATE SET transaction_ids = p.transaction_ids || EXCLUDED.transaction_ids;
    RETURN NULL;
END $$;

CREATE FUNCTION ledger_transactions_balance() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    bad record;
BEGIN
    DELETE FROM ledger_balance_pending WHERE xact = NEW.xact RETURNING transaction_ids INTO ids;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT * INTO bad FROM (
        SELECT transaction_id, currency,
               coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0) AS debits,
               coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0) AS credits,
               count(*) AS n
          FROM ledger_entries
         WHERE transaction_id = ANY(ids)
         GROUP BY transaction_id, currency
    ) totals
     WHERE debits <> credits OR n < 2
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger transaction % does not balance in %: debits % credits % (% entries)',
            bad.transaction_id, bad.currency, bad.debits, bad.credits, bad.n
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER ledger_entries_note
    AFTER INSERT ON ledger_entries REFERENCING NEW TABLE AS new_entries
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_note_entries();

CREATE CONSTRAINT TRIGGER ledger_balance_pending_check
    AFTER INSERT ON ledger_balance_pending DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_transactions_balance();

DROP TRIGGER ledger_entries_balance ON ledger_entries;

DROP FUNCTION ledger_transaction_balances();
"""

DOWNGRADE = """
CREATE FUNCTION ledger_transaction_balances() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad record;
BEGIN
    SELECT currency,
           coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0) AS debits,
           coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0) AS credits,
           count(*) AS n
      INTO bad
      FROM ledger_entries
     WHERE transaction_id = NEW.transaction_id
     GROUP BY currency
    HAVING coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0)
           <> coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0)
        OR count(*) < 2
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'ledger transaction % does not balance in %: debits % credits % (% entries)',
            NEW.transaction_id, bad.currency, bad.debits, bad.credits, bad.n
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER ledger_entries_balance
    AFTER INSERT ON ledger_entries DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger_transaction_balances();

DROP TRIGGER ledger_balance_pending_check ON ledger_balance_pending;

DROP TRIGGER ledger_entries_note ON ledger_entries;

DROP FUNCTION ledger_transactions_balance();

DROP FUNCTION ledger_note_entries();

DROP TABLE ledger_balance_pending;
"""


def _run(sql: str) -> None:
    # asyncpg runs one statement per execute: split before each top-level CREATE / DROP.
    for statement in re.split(r";\s*\n(?=CREATE |DROP )", sql.strip()):
        op.execute(statement.rstrip(";"))


def upgrade() -> None:
    _run(UPGRADE)


def downgrade() -> None:
    _run(DOWNGRADE)
