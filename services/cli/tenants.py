"""`jetlora tenants` (or `jetlora quota`): how the fleet is shared, each tenant's weight, nominal devices, borrowing
limit, fair share, devices borrowed and in use."""

from __future__ import annotations

from schemas import names
from schemas.tenants import TenantList, TenantsQuery
from services.cli import args as args_
from services.cli.client import EXIT_OK, ask, run_client, show
from services.cli.printable import cell


def cmd_tenants(args) -> int:
    subject = names.jobs_api(names.check_tenant(args.tenant) if args.tenant else None).tenants

    async def go(nc):
        show(await ask(nc, subject, TenantsQuery(), TenantList, timeout=args.timeout), args.json, _table)
        return EXIT_OK

    return run_client(args, go)


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
