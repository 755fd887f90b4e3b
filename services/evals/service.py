"""The evals service (jetlora.evals[.<tenant>].<verb>), run beside the scheduler and the registry: evals (items,
graders, sampling), their runs (placed as jobs: runs.py; or through the engine that serves the name: engine_path.py;
or, for samples made elsewhere, graded here: samples.py) and the runs' results, each tenant seeing its own only."""

from __future__ import annotations

import asyncio
import time

import nats.micro
from nats.aio.client import Client

from schemas import names
from schemas.datasets import DatasetQuery, DatasetReply
from schemas.evals import (
    EvalCreate,
    EvalDef,
    EvalList,
    EvalListQuery,
    EvalQuery,
    EvalReply,
    ItemsPage,
    ItemsQuery,
    RunList,
    RunListQuery,
    RunQuery,
    RunReply,
    RunRequest,
)
from schemas.gates import CompareReply, CompareRequest
from schemas.jobs import Error
from services import __version__, bus, graders
from services.aio import cancel_and_wait
from services.evals import compare, engine_path, follow, runs, samples
from services.evals.store import EvalStore
from services.graders import GraderContext
from services.job_records import JobRecords


def criteria_errors(q: EvalCreate) -> Error | None:
    """Every grader checked where it is (`criteria.N.grader...`); names distinct, since results are keyed by them."""
    seen: set[str] = set()
    for n, c in enumerate(q.criteria):
        if c.grader.name in seen:
            return Error(
                f"two criteria are named {c.grader.name!r}: give each grader its own name", f"criteria.{n}.grader.name"
            )
        seen.add(c.grader.name)
        if errors := graders.check(c.grader, f"criteria.{n}.grader"):
            return Error(errors[0].reason, errors[0].field)
    return None


class EvalsService:
    """Answers jetlora.evals.*. Evals and runs are in names.EVALS_KV; any number may run. `grading`: how runs of
    samples are graded here (default: no judge engine, python graders only where the sandbox isolates them)."""

    def __init__(self, nc: Client, grading: GraderContext | None = None) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.grading = grading or GraderContext(command="jetlora scheduler")
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        self.store = EvalStore(self.js, await self.js.key_value(names.EVALS_KV))
        self.jobs = await JobRecords.open(self.js)
        self.engines = engine_path.EngineRuns(self.nc, self.store)  # runs sampled through engines, under way here
        self.sampled = samples.SampleRuns(self.nc, self.store, self.grading)  # runs of samples graded here
        service = await nats.micro.add_service(
            self.nc, name=names.EVALS_SERVICE, version=__version__, description="jetlora evals"
        )
        group = service.add_group(name=names.EVALS_GROUP)
        for verb, request_type, serve in (
            ("create", EvalCreate, self._create),
            ("list", EvalListQuery, self._list),
            ("show", EvalQuery, self._show),
            ("delete", EvalQuery, self._delete),
            ("run", RunRequest, self._run),
            ("runs", RunListQuery, self._runs),
            ("run_show", RunQuery, self._run_show),
            ("run_cancel", RunQuery, self._run_cancel),
            ("run_delete", RunQuery, self._run_delete),
            ("items", ItemsQuery, self._items),
            ("compare", CompareRequest, self._compare),
        ):
            answer = bus.handler(
                lambda q, subject, serve=serve: serve(q, bus.tenant_of(subject)), request_type, with_subject=True
            )
            await bus.add_endpoint(group, f"evals-{verb}", answer, verb)
            await bus.add_endpoint(group, f"evals-tenant-{verb}", answer, f"*.{verb}")
        following = asyncio.create_task(follow.keep_following(self.js, self.store, self.jobs, stop))
        self.ready.set()
        try:
            await stop.wait()
        finally:
            await cancel_and_wait([following])
            await self.engines.close()
            await self.sampled.close()
            await service.stop()

    async def _create(self, q: EvalCreate, tenant: str | None) -> EvalReply | Error:
        if (bad := criteria_errors(q)) is not None:
            return bad
        if q.dataset is not None:
            found = await bus.request(
                self.nc, names.datasets_api(tenant).show, DatasetQuery(name=q.dataset), DatasetReply | Error
            )
            if isinstance(found, Error):
                return Error(f"no dataset {q.dataset}; `jetlora datasets ls` lists them", "dataset")
            if found.dataset.stats.format != "rft":
                return Error(
                    f"dataset {q.dataset} holds {found.dataset.stats.format} rows; an eval's items are rft rows "
                    "(messages ending in a user turn, and the fields its graders read)",
                    "dataset",
                )
        old = await self.store.eval(tenant, q.name)
        if q.replace and old is None:
            return Error(f"no eval named {q.name}; `jetlora evals ls` lists them", "name")
        e = EvalDef(
            name=q.name,
            tenant=tenant,
            dataset=q.dataset,
            criteria=q.criteria,
            sampling=q.sampling,
            title=q.title,
            item_schema=q.item_schema,
            include_sample_schema=q.include_sample_schema,
            metadata=q.metadata,
            created=old.created if old is not None else time.time(),
            updated=time.time(),
        )
        if q.replace:
            await self.store.put_eval(e)
        elif not await self.store.create_eval(e):
            return Error(f"an eval named {q.name} exists; `jetlora evals rm {q.name}` first, or choose another", "name")
        return EvalReply(eval=e)

    async def _eval(self, name: str, tenant: str | None) -> EvalDef | Error:
        found = await self.store.eval(tenant, name)
        return found or Error(f"no eval named {name}; `jetlora evals ls` lists them", "name")

    async def _list(self, q: EvalListQuery, tenant: str | None) -> EvalList:
        return EvalList(evals=await self.store.evals(tenant))

    async def _show(self, q: EvalQuery, tenant: str | None) -> EvalReply | Error:
        found = await self._eval(q.name, tenant)
        return found if isinstance(found, Error) else EvalReply(eval=found)

    async def _delete(self, q: EvalQuery, tenant: str | None) -> EvalReply | Error:
        found = await self._eval(q.name, tenant)
        if isinstance(found, Error):
            return found
        for r in await self.store.runs(tenant):
            if r.eval == q.name and r.tenant == tenant:
                self._stop(r.id)
                await runs.cancel(self.nc, self.store, r)
                await self.store.delete_run(r)
                await engine_path.drop_results(self.js, r)
        await self.store.delete_eval(tenant, q.name)
        return EvalReply(eval=found)

    async def _run(self, q: RunRequest, tenant: str | None) -> RunReply | Error:
        found = await self._eval(q.eval, tenant)
        if isinstance(found, Error):
            return Error(found.error, "eval")
        try:
            if q.samples is not None:
                return RunReply(run=await self.sampled.start(found, q, tenant))
            return RunReply(run=await runs.place(self.nc, self.store, self.engines, found, q, tenant))
        except runs.RunError as e:
            return Error(str(e), e.field)

    async def _runs(self, q: RunListQuery, tenant: str | None) -> RunList:
        found = [
            r
            for r in await self.store.runs(tenant)
            if (q.eval is None or r.eval == q.eval) and (q.adapter is None or r.adapter == q.adapter)
        ]
        return RunList(runs=[await runs.refresh(self.store, self.jobs, r) for r in found])

    async def _find_run(self, run: str, tenant: str | None):
        found = await self.store.run(tenant, run)
        if found is None:
            return Error(f"no eval run {run}; `jetlora evals runs` lists them", "run")
        return await runs.refresh(self.store, self.jobs, found)

    async def _run_show(self, q: RunQuery, tenant: str | None) -> RunReply | Error:
        found = await self._find_run(q.run, tenant)
        return found if isinstance(found, Error) else RunReply(run=found)

    async def _run_cancel(self, q: RunQuery, tenant: str | None) -> RunReply | Error:
        found = await self._find_run(q.run, tenant)
        if isinstance(found, Error):
            return found
        self._stop(found.id)
        return RunReply(run=await runs.cancel(self.nc, self.store, found))

    async def _run_delete(self, q: RunQuery, tenant: str | None) -> RunReply | Error:
        found = await self._find_run(q.run, tenant)
        if isinstance(found, Error):
            return found
        self._stop(found.id)
        await runs.cancel(self.nc, self.store, found)
        await self.store.delete_run(found)
        await engine_path.drop_results(self.js, found)
        return RunReply(run=found)

    def _stop(self, run: str) -> None:
        """The run's task here, if this service asks an engine for it or grades it, cancelled."""
        self.engines.cancel(run)
        self.sampled.cancel(run)

    async def _items(self, q: ItemsQuery, tenant: str | None) -> ItemsPage | Error:
        found = await self._find_run(q.run, tenant)
        if isinstance(found, Error):
            return found
        items, _ = await self.store.results(found)
        page = [i for i in items if i.index > q.after]
        return ItemsPage(items=page[: q.limit], has_more=len(page) > q.limit, via=found.via)

    async def _compare(self, q: CompareRequest, tenant: str | None) -> CompareReply | Error:
        candidate = await self._find_run(q.candidate, tenant)
        if isinstance(candidate, Error):
            return Error(candidate.error, "candidate")
        incumbent = await self._find_run(q.incumbent, tenant)
        if isinstance(incumbent, Error):
            return Error(incumbent.error, "incumbent")
        return await compare.paired(self.store, candidate, incumbent)
