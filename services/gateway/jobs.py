"""/v1/fine_tuning/jobs: create, list, retrieve, cancel, pause, resume, events and checkpoints, each on the
tenant's own subjects (jetlora.api.<tenant>.*), so a key sees and ends only its tenant's jobs."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid

import msgspec
from aiohttp import web

from schemas import names
from schemas.datasets import DatasetInfo
from schemas.events import CheckpointList
from schemas.gateway import CreateJob, FineTuningJob, GatewayJob, Hyperparameters
from schemas.jobs import Accepted, Error, InitAdapter, Rejected, SubmitReply
from schemas.job_status import JobQuery, JobReply, JobSummary
from services import bus
from services.gateway import file_reads, grader_door
from services.gateway.errors import TENANT, OpenAIError, bad_request, json_response, not_found, read_json
from services.gateway.events import JobEvents
from services.gateway.graders import Graders
from services.gateway.lookups import dataset_info, fine_tuned_model, gather_bounded, job_summary, job_summary_or_none
from services.gateway.openai_map import (
    STATUS,
    BaseModel,
    adapter_name,
    checkpoint_object,
    fine_tuning_job,
    hyperparameters,
    job_request,
    shown_hyperparameters,
)
from services.gateway.reinforcement import WHERE, reinforcement_settings
from services.gateway.paging import limit_of, page, paged, unknown_after
from services.gateway.records import JobRecords, metadata_filter
from services.gateway.results import results_file_id
from services.gateway.terms import openai_terms, param_of


GRADER = f"{WHERE}.grader"
UNSURE_RETRIES_S = (0.5, 1.0, 2.0)  # a submission whose storing was unknown is asked again after these


def rejection(reply: Rejected) -> OpenAIError:
    """The scheduler's reasons in the OpenAI request's terms; `param` is the first error's field, as OpenAI's."""
    texts = [
        f"{param_of(e.field)}: {openai_terms(e.reason)}" if e.field else openai_terms(e.reason) for e in reply.errors
    ]
    return bad_request("; ".join(texts), param_of(reply.errors[0].field))


class Jobs:
    def __init__(
        self, nc, records: JobRecords, events: JobEvents, models: dict[str, BaseModel], graders: Graders
    ) -> None:
        self.nc, self.records, self.events, self.models, self.graders = nc, records, events, models, graders

    def routes(self) -> list[web.RouteDef]:
        base = "/v1/fine_tuning/jobs"
        return [
            web.post(base, self.create),
            web.get(base, self.list),
            web.get(base + "/{id}", self.retrieve),
            web.post(base + "/{id}/cancel", self.cancel),
            web.post(base + "/{id}/pause", self.pause),
            web.post(base + "/{id}/resume", self.resume),
            web.get(base + "/{id}/events", self.list_events),
            web.get(base + "/{id}/checkpoints", self.checkpoints),
        ]

    async def _submit(self, tenant: str, jr) -> Accepted:
        """The job submitted; a store that did not answer whether it was stored is asked again with the same
        idempotency key (the same job, never a second), a few times, before the client hears 503."""
        for pause in UNSURE_RETRIES_S:
            reply = await bus.request(self.nc, names.jobs_api(tenant).submit, jr, SubmitReply)
            if isinstance(reply, Rejected):
                raise rejection(reply)
            if isinstance(reply, Accepted):
                return reply
            await asyncio.sleep(pause)
        raise OpenAIError(
            503,
            f"the job store did not answer whether job {reply.job} was stored; list your fine-tuning jobs before "
            "creating it again",
            code="job_store_unavailable",
            type="server_error",
        )

    async def create(self, request: web.Request) -> web.Response:
        tenant, req = request[TENANT], await read_json(request, CreateJob)
        grader = reinforcement_settings(req)[1] if req.method and req.method.type == "reinforcement" else None
        method, hp = hyperparameters(req)
        if method == "supervised" and isinstance(hp, Hyperparameters) and hp.beta != "auto":
            raise bad_request("beta is dpo's: drop it, or set method.type to 'dpo'", "hyperparameters.beta")
        model, start = await self._model(tenant, req.model)
        files = {"training_file": req.training_file, "validation_file": req.validation_file}
        infos = {param: await self._check_file(tenant, file, param) for param, file in files.items() if file}
        if grader is not None:  # as /graders/validate checks it, and its templates against the files' first rows
            await grader_door.sources_load(self.graders, tenant, grader, GRADER)
            for param, info in infos.items():
                if info.stats.format != "rft":
                    continue  # the scheduler refuses it, saying which file a reinforcement job takes
                rows = await file_reads.first_rows(self.nc, info, grader_door.ROWS_CHECKED)
                grader_door.against_rows(grader, GRADER, rows, info.name, param)
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        adapter = adapter_name(req.model, req.suffix, secrets.token_hex(4))
        jr = msgspec.structs.replace(job_request(req, model, method, hp, adapter, seed, grader), init_adapter=start)
        reply = await self._submit(tenant, msgspec.structs.replace(jr, idempotency_key=f"gw-{uuid.uuid4().hex}"))
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
            grader=msgspec.to_builtins(grader) if grader is not None else None,
            fine_tuned_model=adapter,
            created=time.time(),
            eval_steps=jr.train.eval_steps,
        )
        await self.records.put(kept)
        return json_response(await self._object(tenant, await job_summary(self.nc, tenant, reply.job), kept))

    async def _model(self, tenant: str, name: str) -> tuple[BaseModel, InitAdapter | None]:
        """A base model the gateway offers, or a fine-tuned model of the tenant's to go on from, on its base."""
        if name in self.models:
            return self.models[name], None
        found = await fine_tuned_model(self.nc, tenant, name)
        if found is not None and found[1].base_model in self.models:
            return self.models[found[1].base_model], InitAdapter(name=name, version=found[1].version)
        raise bad_request(
            f"model {name!r} is neither a base model of this fleet nor a fine-tuned model of yours; "
            f"base models: {', '.join(sorted(self.models)) or 'none (start the gateway with --base-model)'}; "
            "GET /v1/models lists them all",
            "model",
            "model_not_available",
        )

    async def _check_file(self, tenant: str, file: str, param: str) -> DatasetInfo:
        try:
            info = await dataset_info(self.nc, tenant, file, param)
        except OpenAIError:
            raise bad_request(
                f"invalid {param}: no file '{file}' of yours; upload it with POST /v1/files", param
            ) from None
        if info.stats.format == "evals":
            raise bad_request(
                f"invalid {param}: '{file}' is a file of purpose 'evals' (an eval's items and samples), which eval "
                "runs read; fine-tuning trains on a file of purpose 'fine-tune'",
                param,
            )
        return info

    async def _object(self, tenant: str, summary: JobSummary, kept: GatewayJob | None) -> FineTuningJob:
        """OpenAI's job object; a succeeded job's trained tokens are read from its newest progress event."""
        if STATUS[summary.state] != "succeeded":
            return fine_tuning_job(summary, kept)
        tokens = await self.events.trained_tokens(tenant, summary.id)
        return fine_tuning_job(summary, kept, tokens, results_file_id(summary.id))

    async def _shown(self, tenant: str, summary: JobSummary) -> FineTuningJob:
        found = await self.records.get(tenant, summary.id)
        return await self._object(tenant, summary, found[0] if found else None)

    async def retrieve(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        return json_response(await self._shown(tenant, await job_summary(self.nc, tenant, request.match_info["id"])))

    async def list(self, request: web.Request) -> web.Response:
        """The jobs created through this API, newest first, from the gateway's records (they hold `metadata`): a
        page costs its own jobs' lookups wherever it starts. An `after` that is no job of the tenant's is a 400."""
        tenant, limit, after = request[TENANT], limit_of(request, 20), request.query.get("after")
        keep = metadata_filter(request.query)
        before = None
        if after:
            found = await self.records.get(tenant, after)
            if found is None:
                raise unknown_after(after, "fine-tuning job of yours")
            before = found[1]
        records, cut = await self.records.newest(tenant, before, limit + 1, keep)
        shown = records[:limit]
        summaries = await gather_bounded(job_summary_or_none(self.nc, tenant, r.job) for r in shown)
        data = await gather_bounded(
            self._object(tenant, s, r)
            for s, r in zip(summaries, shown)
            if s is not None  # gone: past retention
        )
        return json_response(paged(list(data), len(records) > limit or cut))

    async def _act(self, request: web.Request, verb: str) -> web.Response:
        tenant, job = request[TENANT], request.match_info["id"]
        await job_summary(self.nc, tenant, job)
        reply = await bus.request(self.nc, getattr(names.jobs_api(tenant), verb), JobQuery(job), JobReply | Error)
        if isinstance(reply, Error):
            raise OpenAIError(400, openai_terms(reply.error), None, "invalid_job_state")
        return json_response(await self._shown(tenant, reply.job))

    async def cancel(self, request: web.Request) -> web.Response:
        return await self._act(request, "cancel")

    async def pause(self, request: web.Request) -> web.Response:
        return await self._act(request, "pause")

    async def resume(self, request: web.Request) -> web.Response:
        return await self._act(request, "resume")

    async def list_events(self, request: web.Request) -> web.Response:
        tenant, job, limit = request[TENANT], request.match_info["id"], limit_of(request, 20)
        await job_summary(self.nc, tenant, job)
        return json_response(await self.events.page(tenant, job, request.query.get("after"), limit))

    async def checkpoints(self, request: web.Request) -> web.Response:
        tenant, job, limit = request[TENANT], request.match_info["id"], limit_of(request, 10)
        await job_summary(self.nc, tenant, job)
        reply = await bus.request(self.nc, names.jobs_api(tenant).checkpoints, JobQuery(job), CheckpointList | Error)
        if isinstance(reply, Error):
            raise not_found("fine-tuning job", job)
        found = await self.records.get(tenant, job)
        adapter = found[0].fine_tuned_model if found else job
        shown = [checkpoint_object(job, adapter, c) for c in reversed(reply.checkpoints)]
        return json_response(page(shown, request.query.get("after"), limit, "checkpoint of this job"))
