"""Re-wrap job: every credential row's data key moved to the latest version of the Transit key.

Run after `bao write -f <transit mount>/keys/<key>/rotate` (and once when moving from the keyring to Transit:
rows whose data key the keyring wrapped are wrapped by Transit instead). Then the old Transit versions can be
retired (`--retire` sets the key's `min_decryption_version`; refused while any row still needs an older one).

- Resumable: rows are taken in credential-id order, `batch_size` at a time. Transit is called with no
  transaction open; the batch's updates then commit in one transaction, each guarded by the row's old
  `wrapped_dek` (a row changed meanwhile is left for the next run). A kill at any point loses nothing: a row
  is either still on its old version (which still opens: nothing is retired until every row has moved) or
  committed on the new one. Running the job again continues with whatever is left.
- Audited: each moved row writes an audit record (`credential.rewrapped`, before/after key id) in the same
  transaction, published by the service's outbox relay.
- The private keys are never decrypted: Transit's `rewrap` moves a wrapped key without revealing it; a key
  the keyring wrapped is unwrapped in this process and wrapped by Transit, and the ciphertext stays as it is.

`python -m gpuaas.app_runtime.rewrap [--batch-size N] [--pause-s S] [--retire]`, with the service's settings
in the environment (`credential_backend=transit`).
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.app_runtime import EVENT_SOURCE, SERVICE
from gpuaas.app_runtime.custody import Sealed, TransitCustody
from gpuaas.app_runtime.models import credentials
from gpuaas.contracts import Actor
from gpuaas.kit import audit
from gpuaas.kit.logging import get_logger
from gpuaas.kit.vault import ciphertext_version

log = get_logger(__name__)
ACTION = "credential.rewrapped"


@dataclass
class RewrapReport:
    moved: int = 0
    skipped: int = 0  # changed by someone else during the run: the next run takes them
    target: str = ""


async def remaining(sessions: async_sessionmaker[AsyncSession], target_kek_id: str) -> int:
    """Rows whose data key is not (yet) wrapped by `target_kek_id`."""
    from sqlalchemy import func

    c = credentials.c
    async with sessions() as s:
        query = select(func.count()).where(c.custody == "schema", c.kek_id.is_distinct_from(target_kek_id))
        return int((await s.execute(query)).scalar_one())


async def rewrap_credentials(
    sessions: async_sessionmaker[AsyncSession],
    custody: TransitCustody,
    *,
    batch_size: int = 100,
    pause_s: float = 0.0,
) -> RewrapReport:
    transit = custody.transit
    target = f"transit:{transit.name}:v{await asyncio.to_thread(transit.latest_version)}"
    report = RewrapReport(target=target)
    actor = Actor.system(f"{EVENT_SOURCE}-rewrap")
    c = credentials.c
    after = uuid.UUID(int=0)
    while True:
        async with sessions() as s:  # read only: nothing is held while Transit is called
            rows = (
                await s.execute(
                    select(c.credential_id, c.tenant_id, c.project_id, c.wrapped_dek, c.dek_nonce, c.kek_id)
                    .where(c.custody == "schema", c.kek_id.is_distinct_from(target), c.credential_id > after)
                    .order_by(c.credential_id)
                    .limit(batch_size)
                )
            ).all()
        if not rows:
            return report
        moves: list[tuple[uuid.UUID, uuid.UUID, uuid.UUID, bytes, str | None, str]] = []
        for cid, tenant, project, wrapped, dek_nonce, kek_id in rows:
            if str(kek_id or "").startswith("transit:"):
                new = await transit.arewrap(bytes(wrapped).decode(), cid.bytes)
            else:  # wrapped by the keyring: unwrap here, wrap by Transit (the ciphertext is unchanged)
                if custody.fallback is None:
                    raise RuntimeError(f"credential {cid} is wrapped by key {kek_id}: the keyring is needed to move it")
                sealed = Sealed(custody="schema", wrapped_dek=bytes(wrapped), dek_nonce=dek_nonce, kek_id=kek_id)
                new = await transit.awrap(custody.fallback.unwrap_dek(cid, sealed), cid.bytes)
            moves.append((cid, tenant, project, bytes(wrapped), kek_id, new))
        async with sessions() as s, s.begin():
            for cid, tenant, project, old, old_kek, new in moves:
                new_kek = f"transit:{transit.name}:v{ciphertext_version(new)}"
                changed = await s.execute(
                    update(credentials)
                    .where(c.credential_id == cid, c.wrapped_dek == old)
                    .values(wrapped_dek=new.encode(), dek_nonce=None, kek_id=new_kek)
                )
                if changed.rowcount != 1:  # pyright: ignore[reportAttributeAccessIssue]
                    report.skipped += 1
                    continue
                await audit.record(
                    s,
                    service=SERVICE,
                    actor=actor,
                    action=ACTION,
                    resource_type="credential",
                    resource_id=cid,
                    tenant_id=tenant,
                    project_id=project,
                    before={"kek_id": old_kek},
                    after={"kek_id": new_kek},
                )
                report.moved += 1
        after = rows[-1][0]
        log.info("credentials_rewrapped", moved=report.moved, target=target)
        if pause_s:
            await asyncio.sleep(pause_s)


async def retire_old_versions(sessions: async_sessionmaker[AsyncSession], custody: TransitCustody) -> int:
    """Set the Transit key's min_decryption_version to the latest, once no row needs an older one."""
    transit = custody.transit
    latest = await asyncio.to_thread(transit.latest_version)
    left = await remaining(sessions, f"transit:{transit.name}:v{latest}")
    if left:
        raise RuntimeError(f"{left} credential rows are not on Transit v{latest} yet: run the re-wrap first")
    await transit.vault.acall(
        f"retire versions of {transit.name}",
        lambda client: client.secrets.transit.update_key_configuration(
            name=transit.name, min_decryption_version=latest, mount_point=transit.mount
        ),
    )
    return latest


async def _main(batch_size: int, pause_s: float, retire: bool) -> int:
    from gpuaas.app_runtime.custody import make_custody
    from gpuaas.app_runtime.settings import Settings
    from gpuaas.kit.db import create_engine, session_factory
    from gpuaas.kit.vault_keys import service_keys

    settings = Settings()
    custody = make_custody(settings, (await service_keys(settings, secrets_at_rest=True)).keyring)
    if not isinstance(custody, TransitCustody):
        print("credential_backend must be `transit` to re-wrap")
        return 2
    engine = create_engine(settings.database_url.get_secret_value(), settings.schema, app_name="app_runtime-rewrap")
    try:
        sessions = session_factory(engine)
        report = await rewrap_credentials(sessions, custody, batch_size=batch_size, pause_s=pause_s)
        print(f"moved {report.moved} rows to {report.target}; {report.skipped} changed meanwhile (run again)")
        if retire:
            print(f"older versions retired: min_decryption_version = {await retire_old_versions(sessions, custody)}")
    finally:
        await engine.dispose()
    return 0 if report.skipped == 0 else 1


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m gpuaas.app_runtime.rewrap", description=summary)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--pause-s", type=float, default=0.0, help="pause between batches (spares the server)")
    parser.add_argument("--retire", action="store_true", help="then retire the older Transit key versions")
    args = parser.parse_args(argv)
    return asyncio.run(_main(args.batch_size, args.pause_s, args.retire))


if __name__ == "__main__":
    raise SystemExit(main())
