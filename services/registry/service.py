"""The registry's request endpoints (jetlora.adapters.*) and the registration of a succeeded job's adapter."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import nats.micro
from nats.aio.client import Client

from schemas import names
from schemas.gates import GateSpec
from schemas.jobs import Error
from schemas.training import MUTATING_INITS
from schemas.registry import (
    AdapterList,
    AdapterListQuery,
    AdapterQuery,
    AdapterReply,
    AdapterVersion,
    Alias,
    AliasRequest,
    Canary,
    PromoteRequest,
    References,
    ReferencesQuery,
    RegisterRequest,
    StoredFile,
)
from services import __version__, bus
from services.aio import cancel_and_wait
from services.controller import SharedRead
from services.job_records import JobRecords
from services.registry import canary, gate, gated_canary
from services.registry.nodes import DEPARTED_S, SWEEP_S, NodeLiveness
from services.registry.store import AdapterRegistry, RegistryError, registry_view

log = logging.getLogger(__name__)


async def register_job(
    jobs: JobRecords,
    registry: AdapterRegistry,
    name: str,
    job_id: str,
    promote: bool = False,
    gate_spec: GateSpec | None = None,
) -> AdapterVersion:
    """The job's stored artifacts as the next version of `name`; RegistryError says why not. The job's record is
    read through the jobs bucket's stored format (services/job_records.py), never asked of the scheduler: it
    answers while the scheduler is between leaders."""
    found = await jobs.find(job_id)
    if found is None:
        raise RegistryError(f"no job {job_id}; `jetlora jobs` lists them")
    stored, status = found
    session = stored.request.session  # a Tinker training session ends stopped, its adapter stored
    if status is None or status.state not in ("succeeded", "stopped" if session else "succeeded"):
        raise RegistryError(
            f"job {job_id} is {status.state if status else 'queued'}; only a succeeded job's adapter is registered"
            + (" (a session's, once its client finished it)" if session else "")
        )
    files = {a.kind: StoredFile(name=a.name, sha256=a.sha256, size=a.size) for a in status.artifacts}
    if "peft" not in files:
        raise RegistryError(f"job {job_id} stored no PEFT adapter; it cannot be registered")
    req = stored.request
    r, alpha = (session.rank, float(session.rank)) if session else stored_rank(req.lora)
    targets = session.target_modules() if session else list(req.lora.target_modules)
    version = await registry.add_version(
        AdapterVersion(
            name=name,
            version=1,
            job=job_id,
            base_model=req.model,
            peft=files["peft"],
            gguf=files.get("gguf"),
            r=r,
            alpha=alpha,
            target_modules=targets,
            final_loss=status.loss,
            eval_loss=status.eval_loss,
            probe=next((a.probe for a in status.artifacts if a.kind == "peft"), None),
        ),
        tenant=stored.tenant,
    )
    if promote and gate_spec is not None:  # the gate promotes it, or not (gate.py)
        base_dir = gate_spec.base_dir or req.base_dir
        await registry.note_alias(name, lambda a: gate.begin(a, gate_spec, version, base_dir, req.accelerator))
    elif promote:
        await registry.change_alias(name, lambda a: _promoted(a, version.version), expect=None)
    done = (
        " and promoted it"
        if promote and gate_spec is None
        else (" gated by eval " + gate_spec.eval if gate_spec else "")
    )
    log.info("registered %s@%d from job %s%s", name, version.version, job_id, done)
    return version


def stored_rank(lora) -> tuple[int, float]:
    """The rank and alpha of the adapter as stored: pissa's and loftq's are a plain LoRA of 2r, scale unchanged."""
    if lora.init in MUTATING_INITS:
        return 2 * lora.r, lora.alpha * (2**0.5 if lora.rslora else 2)
    return lora.r, lora.alpha


def _promoted(alias: Alias, version: int) -> Alias:
    history = (
        alias.history + [alias.current] if alias.current is not None and alias.current != version else alias.history
    )
    return msgspec.structs.replace(alias, current=version, history=history, retired=False, canary=None, gate=None)


def _rolled_back(alias: Alias) -> Alias:
    if not alias.history:
        raise RegistryError(f"{alias.name} has no earlier version to roll back to")
    return msgspec.structs.replace(
        alias, current=alias.history[-1], history=alias.history[:-1], retired=False, canary=None, gate=None
    )


def _retired(alias: Alias) -> Alias:
    history = alias.history + [alias.current] if alias.current is not None else alias.history
    return msgspec.structs.replace(alias, current=None, history=history, retired=True, canary=None, gate=None)


class RegistryService:
    """Answers jetlora.adapters.*. Any number may run: every change is a compare-and-set on the bucket."""

    def __init__(self, nc: Client, departed_s: float = DEPARTED_S, sweep_s: float = SWEEP_S) -> None:
        """departed_s: a node not heard this long has left, and its statuses are removed (looked for every
        sweep_s: nodes.py)."""
        self.nc, self.js = nc, nc.jetstream()
        self.departed_s, self.sweep_s = departed_s, sweep_s
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        view = registry_view(self.js)
        self.registry = AdapterRegistry(await self.js.key_value(names.ADAPTERS_KV), view, self.js)
        self.jobs = await JobRecords.open(self.js)
        self.nodes = NodeLiveness(self.nc, self.registry, self.departed_s, self.sweep_s)
        following = asyncio.create_task(view.run(stop), name="registry-view")
        hearing = asyncio.create_task(self.nodes.run(stop), name="registry-nodes")
        self.deciding = SharedRead(  # canaries and gates decided from one read of the registry a pass
            "the adapter registry",
            self.registry.adapters,
            canary.controller(self.registry),
            gate.controller(self.nc, self.registry, _promoted, self._canaried),
        )
        deciding = asyncio.create_task(self.deciding.run(stop), name="canaries-and-gates")
        try:
            await self._serve(stop)
        finally:
            await cancel_and_wait([following, hearing, deciding])

    async def _serve(self, stop: asyncio.Event) -> None:
        service = await nats.micro.add_service(
            self.nc, name=names.ADAPTER_SERVICE, version=__version__, description="jetlora adapter registry"
        )
        group = service.add_group(name=names.ADAPTERS_GROUP)
        for verb, request_type, serve in (
            ("register", RegisterRequest, self._register),
            ("list", AdapterListQuery, self._list),
            ("show", AdapterQuery, self._show),
            ("promote", PromoteRequest, self._promote),
            ("rollback", AliasRequest, self._rollback),
            ("retire", AliasRequest, self._retire),
            ("references", ReferencesQuery, self._references),
        ):
            await bus.add_endpoint(group, f"adapters-{verb}", bus.handler(serve, request_type), verb)
        self.ready.set()
        try:
            await stop.wait()
        finally:
            await service.stop()

    async def _reply(self, name: str) -> AdapterReply | Error:
        found = (await self.registry.adapters(only=name)).get(name)
        if found is None:
            return Error(f"no adapter named {name}; `jetlora adapters ls` lists them", field="name")
        return found

    async def _register(self, q: RegisterRequest) -> AdapterReply | Error:
        try:
            await register_job(self.jobs, self.registry, q.name, q.job, q.promote, q.gate)
        except RegistryError as e:
            return Error(str(e), field="job")
        return await self._reply(q.name)

    async def _list(self, q: AdapterListQuery) -> AdapterList:
        return AdapterList(
            adapters=[
                r
                for r in (await self.registry.adapters()).values()
                if q.base_model is None or any(v.base_model == q.base_model for v in r.versions)
            ]
        )

    async def _show(self, q: AdapterQuery) -> AdapterReply | Error:
        return await self._reply(q.name)

    async def _change(self, name: str, change, q: PromoteRequest | AliasRequest) -> AdapterReply | Error:
        try:
            await self.registry.change_alias(name, change, q.expect, q.expect_changes)
        except RegistryError as e:
            return Error(str(e), field="name")
        return await self._reply(name)

    async def _promote(self, q: PromoteRequest) -> AdapterReply | Error:
        if await self.registry.version(q.name, q.version) is None:
            return Error(
                f"no version {q.name}@{q.version}; `jetlora adapters show {q.name}` lists its versions", field="version"
            )
        if q.gate is not None:
            return await self._gated(q)
        if q.canary is None:
            return await self._change(q.name, lambda a: _promoted(a, q.version), q)
        try:
            trial = await self._pick(q.name, q.canary, q.version, q.canary_deadline_s)
        except RegistryError as e:
            return Error(str(e), field="canary")
        return await self._change(q.name, lambda a: msgspec.structs.replace(a, canary=trial, retired=False), q)

    async def _pick(self, name: str, spec: str, version: int, deadline_s: float) -> Canary:
        """The canary nodes for NAME@version now (canary.pick); RegistryError says why there are none."""
        after = await self.registry.newest_seq()  # reports stored after this count for the canary
        reply = await self._reply(name)
        if isinstance(reply, Error):
            raise RegistryError(reply.error)
        return canary.pick(reply, spec, version, deadline_s, self.nodes.live, after)

    async def _canaried(self, alias: Alias, decided: gate.Decided) -> None:
        """A gate asked with --canary passed: its canary starts, carrying the eval (gated_canary.py)."""
        await gated_canary.start(self.nc, self.registry, alias, decided, self._pick)

    async def _gated(self, q: PromoteRequest) -> AdapterReply | Error:
        """Start a gated promote: stored in the alias and answered at once; gate.py decides it (and, asked with a
        canary, its canary then: gated_canary.py). A canary that could not start now is refused now."""
        spec, version = q.gate, await self.registry.version(q.name, q.version)
        assert spec is not None and version is not None
        if q.canary is not None:
            try:
                await self._pick(q.name, q.canary, q.version, q.canary_deadline_s)
            except RegistryError as e:
                return Error(str(e), "canary")
        alias, _ = await self.registry.alias(q.name)
        if (why := await gate.eval_exists(self.nc, alias.tenant if alias else None, spec.eval)) is not None:
            return Error(f"the gate cannot use eval {spec.eval}: {why}", "gate.eval")
        try:
            base_dir, accelerator = await gate.where(self.jobs, version, spec)
        except RegistryError as e:
            return Error(str(e), "gate.base_dir")
        trial = (q.canary, q.canary_deadline_s) if q.canary is not None else None
        return await self._change(q.name, lambda a: gate.begin(a, spec, version, base_dir, accelerator, trial), q)

    async def _rollback(self, q: AliasRequest) -> AdapterReply | Error:
        return await self._change(q.name, _rolled_back, q)

    async def _retire(self, q: AliasRequest) -> AdapterReply | Error:
        return await self._change(q.name, _retired, q)

    async def _references(self, q: ReferencesQuery) -> References:
        return References(jobs=await self.registry.references(q.jobs))
