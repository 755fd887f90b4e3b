"""`jetlora tenants` (or `jetlora quota`): how the fleet is shared, each tenant's weight, nominal devices, borrowing
limit, fair share, devices borrowed and in use; `jetlora tenants set NAME --weight W --devices N --borrow B ...` and
`jetlora tenants rm NAME` change a tenant's quota in the tenants bucket (names.TENANTS_KV), which the scheduler
follows: an admin's, taking effect at its next pass without a restart."""

from __future__ import annotations

import json

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from schemas import names
from schemas.tenants import TenantList, TenantRecord, TenantsQuery, record_errors, tenant_key
from services.cli import args as args_
from services.cli.client import EXIT_OK, EXIT_REJECTED, CommandFailed, ask, run_client, show
from services.cli.printable import cell

NUMBERS = {"devices": int, "borrow": int, "queued": int, "priority": int, "weight": float}  # `none`: no limit
_dec = msgspec.json.Decoder(TenantRecord)


def cmd_tenants(args) -> int:
    action = getattr(args, "action", None)
    if action in ("set", "rm"):
        return run_client(args, lambda nc: _set(nc, args) if action == "set" else _rm(nc, args))
    subject = names.jobs_api(names.check_tenant(args.tenant) if args.tenant else None).tenants

    async def go(nc):
        show(await ask(nc, subject, TenantsQuery(), TenantList, timeout=args.timeout), args.json, _table)
        return EXIT_OK

    return run_client(args, go)


def changed_record(record: TenantRecord, args) -> TenantRecord:
    """The stored record (or the defaults) with the flags given put in, checked: each mistake names its flag and
    the fix (CommandFailed: nothing is written)."""
    problems: list[str] = []
    changes: dict[str, object] = {}
    for name, kind in NUMBERS.items():
        text = getattr(args, name)
        if text is None:
            continue
        if text == "none" and name != "weight":
            changes[name] = None
            continue
        try:
            changes[name] = kind(text)
        except ValueError:
            problems.append(f"--{name} {text}: give a {'number' if kind is float else 'whole number'}")
    if args.preempt is not None:
        changes["preempt"] = args.preempt
    if not problems:
        record = msgspec.structs.replace(record, **changes)
        problems = [f"--{e.field} {getattr(args, e.field)}: {e.reason}" for e in record_errors(record)]
    if problems:
        raise CommandFailed("; ".join(problems) + " (nothing was written)", EXIT_REJECTED)
    return record


async def _set(nc, args) -> int:
    tenant = _tenant(args)
    kv = await nc.jetstream().key_value(names.TENANTS_KV)
    for _ in range(5):  # another admin's change between our read and write: read it again and put ours in
        try:
            entry = await kv.get(tenant_key(tenant))
            stored, revision = _dec.decode(entry.value or b""), entry.revision
        except KeyNotFoundError:
            stored, revision = TenantRecord(), None
        record = changed_record(stored, args)
        value = msgspec.json.encode(record)
        try:
            if revision is None:
                await kv.create(tenant_key(tenant), value)
            else:
                await kv.update(tenant_key(tenant), value, last=revision)
        except KeyWrongLastSequenceError:
            continue
        shown = msgspec.to_builtins(record)
        if args.json:
            print(json.dumps({"tenant": tenant, **shown}))
        else:
            print(f"tenant {tenant}: " + ", ".join(f"{k} {'none' if v is None else v}" for k, v in shown.items()))
        return EXIT_OK
    raise CommandFailed(f"tenant {tenant}'s quota kept changing under this command; run it again")


async def _rm(nc, args) -> int:
    tenant = _tenant(args)
    kv = await nc.jetstream().key_value(names.TENANTS_KV)
    try:
        await kv.get(tenant_key(tenant))
    except KeyNotFoundError:
        raise CommandFailed(f"no tenant {tenant} in {names.TENANTS_KV}; `jetlora tenants` lists them") from None
    await kv.delete(tenant_key(tenant))
    print(
        json.dumps({"tenant": tenant, "deleted": True}) if args.json else f"tenant {tenant}: the default quota applies"
    )
    return EXIT_OK


def _tenant(args) -> str:
    """The tenant to change, checked; only an admin changes tenants."""
    if args.tenant:
        raise CommandFailed(
            f"--tenant {args.tenant}: a tenant cannot {args.action} tenants' quotas; an admin does (leave out "
            "--tenant and JETLORA_TENANT)",
            EXIT_REJECTED,
        )
    try:
        return names.check_tenant(args.name)
    except ValueError as e:
        raise CommandFailed(f"NAME: {e}", EXIT_REJECTED) from None


def _table(reply: TenantList) -> None:
    from rich.console import Console
    from rich.table import Table

    admins = "placed before tenants" if reply.admin_class == "above" else "among tenants"
    print(f"sharing: {reply.sharing} over {reply.devices} devices (admins' jobs: {admins})")
    t = Table("tenant", "weight", "nominal", "borrow limit", "fair share", "in use", "borrowed", "queued")
    for r in reply.tenants:
        t.add_row(
            cell(r.tenant if r.tenant is not None else "(admins)"),
            f"{r.weight:g}",
            str(r.nominal),
            "none" if r.borrow_limit is None else str(r.borrow_limit),
            str(r.fair_share),
            str(r.in_use),
            str(r.borrowed),
            f"{r.queued} ({r.wanted} devices)" if r.queued else "0",
        )
    Console().print(t)


def register(sub: args_.SubCommands) -> None:
    for name in ("tenants", "quota"):  # `jetlora quota` is the same command
        p = args_.client(sub, name, "each tenant's weight, nominal devices, fair share, devices borrowed and in use")
        p.set_defaults(fn=cmd_tenants)
        actions = p.add_subparsers(dest="action", required=False, metavar="{set,rm}")
        as_tenant = "a tenant may not change quotas (an admin's): refused"
        s = args_.action(
            actions, "set", "change a tenant's quota (an admin's; flags left out keep what is stored)", as_tenant
        )
        s.add_argument("name", metavar="NAME", help="the tenant")
        s.add_argument("--weight", help="its weight in the fair share (default 1)")
        s.add_argument("--devices", help="fair sharing: nominal devices, guaranteed while it wants them; fifo: a cap")
        s.add_argument("--borrow", help="devices it may hold beyond nominal (none: no limit, the default)")
        s.add_argument("--preempt", choices=("own", "none"), help="own: its jobs preempt its own lower-priority ones")
        s.add_argument("--queued", help="its jobs waiting at once (default 10,000; none: no limit)")
        s.add_argument("--priority", help="the highest priority its jobs may ask for (default 0)")
        r = args_.action(actions, "rm", "remove a tenant's quota: the default quota applies to it", as_tenant)
        r.add_argument("name", metavar="NAME", help="the tenant")
