"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, pause, resume, events and checkpoints, each on the
tenant's own subjects (jetlora.api.<tenant>.*), so a key sees and ends only its tenant's jobs."""

from __future__ import annotations

import secrets
import time

import msgspec
from aiohttp import web
from nats.js.errors import KeyNotFoundError

from schemas import names
from schemas.datasets import DatasetQuery, DatasetReply
from schemas.events import CheckpointList, EventPage, EventsQuery
from schemas.gateway import CreateJob, GatewayJob, Page
from schemas.jobs import Accepted, Error, InitAdapter, JobList, JobListQuery, JobQuery, JobReply, JobSummary, Rejected
from schemas.registry import AdapterQuery, AdapterReply
from services import bus
from services.gateway.errors import TENANT, is_token, OpenAIError, bad_request, decode, json_response, not_found
from services.gateway.openai_map import (
    FIELD_PARAMS,
    BaseModel,
    adapter_name,
    checkpoint_object,
    event_object,
    fine_tuning_job,
    hyperparameters,
    job_request,
    shown_hyperparameters,
)

EVENTS_PAGE = 1000


def gateway_job_key(tenant: str, job: str) -> str:
    """Where the gateway keeps what a job was created with, in its GATEWAY_JOBS_KV bucket."""
    return f"{tenant}.{job}"


def _limit(request: web.Request, default: int) -> int:
    try:
        limit = int(request.query.get("limit", default))
    except ValueError:
        raise bad_request("limit must be a whole number from 1 to 100", "limit") from None
    if not 1 <= limit <= 100:
        raise bad_request("limit must be from 1 to 100", "limit")
    return limit


def _page(items: list, after: str | None, limit: int, ident=lambda x: x.id) -> Page:
    """Items newest first; those after the one whose id is `after`, `limit` of them."""
    if after:
        ids = [ident(x) for x in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    shown = items[:limit]
    return Page(
        data=shown,
        has_more=len(items) > limit,
        first_id=ident(shown[0]) if shown else None,
        last_id=ident(shown[-1]) if shown else None,
    )


class Jobs:
    def __init__(self, nc, kv, models: dict[str, BaseModel]) -> None:
        self.nc, self.kv, self.models = nc, kv, models
        self._kept = msgspec.json.Decoder(GatewayJob).decode

    def routes(self) -> list[web.RouteDef]:
        base = "/v1/fine_tuning/jobs"
        return [
            web.post(base, self.create),
            web.get(base, self.list),
            web.get(base + "/{id}", self.retrieve),
            web.post(base + "/{id}/cancel", self.cancel),
            web.post(base + "/{id}/pause", self.pause),
            web.post(base + "/{id}/resume", self.resume),
            web.get(base + "/{id}/events", self.events),
            web.get(base + "/{id}/checkpoints", self.checkpoints),
        ]

    async def create(self, request: web.Request) -> web.Response:
        tenant, req = request[TENANT], decode(await request.read(), CreateJob)
        method, hp = hyperparameters(req)
        if method == "supervised" and hp.beta != "auto":
            raise bad_request("beta is dpo's: drop it, or set method.type to 'dpo'", "hyperparameters.beta")
        model, start = await self._model(req.model)
        for param, file in (("training_file", req.training_file), ("validation_file", req.validation_file)):
            if file is not None:
                await self._check_file(tenant, file, param)
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        adapter = adapter_name(req.model, req.suffix, secrets.token_hex(4))
        jr = msgspec.structs.replace(job_request(req, model, method, hp, adapter, seed), init_adapter=start)
        reply = await bus.request(self.nc, names.jobs_api(tenant).submit, jr, Accepted | Rejected)
        if isinstance(reply, Rejected):
            first = reply.errors[0]
            field: str | None = next(
                (p for f, p in FIELD_PARAMS.items() if first.field.startswith(f)), first.field or None
            )
            raise bad_request("; ".join(f"{e.field}: {e.reason}" for e in reply.errors), field)
        kept = GatewayJob(
            job=reply.job,
            tenant=tenant,
            model=req.model,
            training_file=req.training_file,
            validation_file=req.validation_file,
            suffix=req.suffix,
            seed=seed,
            metadata=req.metadata,
            method=method,  # type: ignore[arg-type]
            hyperparameters=shown_hyperparameters(hp, jr.train),
            fine_tuned_model=adapter,
            created=time.time(),
        )
        await self.kv.put(gateway_job_key(tenant, reply.job), msgspec.json.encode(kept))
        return json_response(fine_tuning_job(await self._summary(tenant, reply.job), kept))

    async def _model(self, name: str) -> tuple[BaseModel, InitAdapter | None]:
        """A base model the gateway offers, or a fine-tuned model (a registered adapter) to go on from, on its base;
        the scheduler checks at submit that the adapter is the tenant's own."""
        if name in self.models:
            return self.models[name], None
        reply = (
            await bus.request(self.nc, names.ADAPTERS.show, AdapterQuery(name=name), AdapterReply | Error)
            if is_token(name)
            else None
        )
        if isinstance(reply, AdapterReply) and reply.alias.current is not None:
            version = next((v for v in reply.versions if v.version == reply.alias.current), None)
            if version is not None and version.base_model in self.models:
                return self.models[version.base_model], InitAdapter(name=name, version=version.version)
        raise bad_request(
            f"model {name!r} is neither a base model of this fleet nor a fine-tuned model of yours; "
            f"base models: {', '.join(sorted(self.models)) or 'none (start the gateway with --base-model)'}",
            "model",
            "model_not_available",
        )

    async def _check_file(self, tenant: str, file: str, param: str) -> None:
        reply = (
            await bus.request(self.nc, names.datasets_api(tenant).show, DatasetQuery(name=file), DatasetReply | Error)
            if is_token(file)
            else None
        )
        if not isinstance(reply, DatasetReply):
            raise bad_request(f"invalid {param}: no file '{file}' of yours; upload it with POST /v1/files", param)

    async def _summary(self, tenant: str, job: str) -> JobSummary:
        if not is_token(job):
            raise not_found("fine-tuning job", job)
        reply = await bus.request(self.nc, names.jobs_api(tenant).job, JobQuery(job), JobReply | Error)
        if isinstance(reply, Error):
            raise not_found("fine-tuning job", job)
        return reply.job

    async def _kept_of(self, tenant: str, job: str) -> GatewayJob | None:
        try:
            entry = await self.kv.get(gateway_job_key(tenant, job))
        except KeyNotFoundError:
            return None
        return self._kept(entry.value) if entry.value else None

    async def _shown(self, tenant: str, summary: JobSummary):
        return fine_tuning_job(summary, await self._kept_of(tenant, summary.id))

    async def retrieve(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        return json_response(await self._shown(tenant, await self._summary(tenant, request.match_info["id"])))

    async def list(self, request: web.Request) -> web.Response:
        tenant, limit, after = request[TENANT], _limit(request, 20), request.query.get("after")
        jobs: list[JobSummary] = []
        cursor = None
        while True:  # newest first: pages until `after` and `limit` more than it are in hand
            page = await bus.request(
                self.nc, names.jobs_api(tenant).jobs, JobListQuery(limit=1000, after=cursor), JobList
            )
            jobs += page.jobs
            ids = [j.id for j in jobs]
            start = 0 if after is None else ids.index(after) + 1 if after in ids else None
            if page.next is None or (start is not None and len(jobs) - start > limit):
                break
            cursor = page.next
        shown = _page(jobs, after, limit)
        shown.data = [await self._shown(tenant, j) for j in shown.data]
        return json_response(shown)

    async def _act(self, request: web.Request, verb: str) -> web.Response:
        tenant, job = request[TENANT], request.match_info["id"]
        await self._summary(tenant, job)
        reply = await bus.request(self.nc, getattr(names.jobs_api(tenant), verb), JobQuery(job), JobReply | Error)
        if isinstance(reply, Error):
            raise OpenAIError(400, reply.error, None, "invalid_job_state")
        return json_response(await self._shown(tenant, reply.job))

    async def cancel(self, request: web.Request) -> web.Response:
        return await self._act(request, "cancel")

    async def pause(self, request: web.Request) -> web.Response:
        return await self._act(request, "pause")

    async def resume(self, request: web.Request) -> web.Response:
        return await self._act(request, "resume")

    async def events(self, request: web.Request) -> web.Response:
        tenant, job, limit = request[TENANT], request.match_info["id"], _limit(request, 20)
        await self._summary(tenant, job)
        found, after = [], 0
        while True:
            page = await bus.request(
                self.nc,
                names.jobs_api(tenant).events,
                EventsQuery(job=job, after=after, limit=EVENTS_PAGE),
                EventPage | Error,
            )
            if isinstance(page, Error):
                raise not_found("fine-tuning job", job)
            found += [e for e in map(event_object, page.events) if e is not None]
            if not page.more or not page.events:
                break
            after = page.next
        return json_response(_page(found[::-1], request.query.get("after"), limit))

    async def checkpoints(self, request: web.Request) -> web.Response:
        tenant, job, limit = request[TENANT], request.match_info["id"], _limit(request, 10)
        await self._summary(tenant, job)
        reply = await bus.request(self.nc, names.jobs_api(tenant).checkpoints, JobQuery(job), CheckpointList | Error)
        if isinstance(reply, Error):
            raise not_found("fine-tuning job", job)
        kept = await self._kept_of(tenant, job)
        adapter = kept.fine_tuned_model if kept else job
        found = [checkpoint_object(job, adapter, c) for c in reversed(reply.checkpoints)]
        return json_response(_page(found, request.query.get("after"), limit))
