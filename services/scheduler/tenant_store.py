"""Tenants as state: each tenant's quota (weight, nominal devices, borrowing limit, preempt policy, queued jobs,
priority ceiling) in names.TENANTS_KV, which `jetlora tenants set|rm` edits while the scheduler runs.

The scheduler's --quota flags seed the bucket at its first start (a `seeded` key says it happened: later starts
never write over what is stored, and say which flags they leave unapplied). Every scheduler, leading or standing by,
follows the bucket with one long-lived view (services/store_views.kv_view) and puts what it holds into its config:
a change takes effect at the next placement pass and preemption check, without a restart. A record that does not
hold (written by hand, say) is left out, loudly: that tenant gets the default quota."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from schemas import names
from schemas.tenants import SEEDED_KEY, TenantRecord, record_errors, tenant_key, tenant_of_key
from services.aio import sleep_unless_stopped
from services.scheduler.config import SchedulerConfig, TenantQuota
from services.store_views import kv_view
from services.streamview import StaleView

log = logging.getLogger(__name__)
FOLLOW_S = 0.1  # how often the view is looked at for a change (no request: a look at what it applied)
AGAIN_S = 1.0  # after following the bucket failed
LOADED_S = 10.0  # a scheduler about to lead waits this long for the bucket's tenants, then tries again
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(TenantRecord)


def _decode(key: str, value: bytes) -> TenantQuota | str | None:
    """A tenant's quota; a string says why a record was left out; None for keys that hold no tenant."""
    if tenant_of_key(key) is None:
        return None
    try:
        record = _dec.decode(value)
    except msgspec.ValidationError as e:
        return f"it does not decode ({e})"
    errors = record_errors(record)
    if errors:
        return "; ".join(f"{e.field}: {e.reason}" for e in errors)
    return TenantQuota.of(record)


class TenantStore:
    """The tenants bucket as one scheduler sees it: seeded once from its flags, followed into `cfg.quotas`."""

    def __init__(self, js, cfg: SchedulerConfig, changed=lambda: None) -> None:
        self.js, self.cfg, self.changed = js, cfg, changed
        self.seeds = dict(cfg.quotas)  # the --quota flags: written into the bucket at its first start only
        self.view = kv_view(js, names.TENANTS_KV, _decode)
        self.loaded = asyncio.Event()  # the bucket's tenants are in the config
        self._refused: dict[str, str] = {}  # records left out, and why (logged once each)

    async def seed(self) -> None:
        """At the bucket's first start, write each --quota flag's tenant into it (a tenant already stored keeps its
        record); later, only say which flags are left unapplied."""
        kv = await self.js.key_value(names.TENANTS_KV)
        try:
            await kv.get(SEEDED_KEY)
            seeded = True
        except KeyNotFoundError:
            seeded = False
        if seeded:
            if self.seeds:
                log.info(
                    "tenants: the bucket %s holds the tenants; --quota for %s is not applied over it (`jetlora "
                    "tenants set` changes a tenant)",
                    names.TENANTS_KV,
                    ", ".join(sorted(self.seeds)),
                )
            return
        for tenant, quota in self.seeds.items():
            try:
                await kv.create(tenant_key(tenant), _enc.encode(quota.record()))
            except KeyWrongLastSequenceError:  # stored already (an edit, or a start that stopped half-way)
                pass
        try:
            await kv.create(SEEDED_KEY, _enc.encode({"at": time.time()}))
        except KeyWrongLastSequenceError:  # another scheduler seeded it at the same moment
            pass

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the bucket until `stop`: the view, and what it holds put into the config as it changes; should
        following fail, it starts again loudly."""
        while not stop.is_set():
            follower = asyncio.create_task(self.view.run(stop))
            try:
                await self._apply_changes(stop, follower)
            except Exception:
                log.exception("tenants: following %s failed; following it again in %.0fs", names.TENANTS_KV, AGAIN_S)
                self.view = kv_view(self.js, names.TENANTS_KV, _decode)
                await sleep_unless_stopped(stop, AGAIN_S)
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)

    async def _apply_changes(self, stop: asyncio.Event, follower: asyncio.Task) -> None:
        applied = -1
        while not stop.is_set():
            if follower.done():  # the view's own loop ends only at stop
                raise RuntimeError(f"the view stopped: {follower.exception()!r}")
            if self.view.seen != applied:
                try:
                    entries = await self.view.snapshot()
                except StaleView as e:
                    log.warning("tenants: %s", e)
                else:
                    applied = self.view.seen
                    self._apply(entries)
            if await sleep_unless_stopped(stop, FOLLOW_S):
                return

    def _apply(self, entries) -> None:
        quotas: dict[str, TenantQuota] = {}
        for key, value in entries.items():
            tenant = tenant_of_key(key)
            if tenant is None:
                continue
            if isinstance(value, str):
                if self._refused.get(tenant) != value:
                    log.error(
                        "tenants: the record of %s in %s is left out, the default quota applies (%s); write it "
                        "again with `jetlora tenants set %s`",
                        tenant,
                        names.TENANTS_KV,
                        value,
                        tenant,
                    )
                self._refused[tenant] = value
                continue
            self._refused.pop(tenant, None)
            quotas[tenant] = value
        if quotas != self.cfg.quotas:
            if self.loaded.is_set():
                log.info("tenants: the bucket changed; %d tenants with a quota of their own", len(quotas))
            self.cfg.quotas = quotas
            self.changed()
        self.loaded.set()

    async def ready(self) -> None:
        """Until the bucket's tenants are in the config (a scheduler leads with them only); TimeoutError after
        LOADED_S."""
        await asyncio.wait_for(self.loaded.wait(), LOADED_S)
