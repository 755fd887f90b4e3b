"""/v1/evals, /v1/evals/{id}/runs and their output_items, as OpenAI's client calls them, on the evals service's
tenant subjects (jetlora.evals.<tenant>.<verb>): a key sees only its tenant's evals and runs (another's are a 404,
lists hold none of them). An eval's testing_criteria are graders (evals/mapping.py); a run's items are rendered and
stored as its own dataset (evals/items.py), then placed by the evals service as a job against a base model of the
gateway's or a fine-tuned model of the tenant's; a `jsonl` run's rows carry their samples (evals/samples.py), which the
evals service grades as sent."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from aiohttp import web

from schemas import names
from schemas.datasets import DatasetDeleted, DatasetQuery
from schemas.evals import EvalCreate, EvalDef, EvalList, EvalReply, EvalRun, ItemsPage, ItemsQuery, RunList, RunReply
from schemas.evals import EvalQuery, RunListQuery, RunQuery, RunRequest
from schemas.jobs import Error
from services import bus
from services.gateway import grader_door
from services.gateway.evals import item_schema, output_items
from services.gateway.evals import items as eval_items
from services.gateway.evals import mapping as evals_map
from services.gateway.evals import samples as eval_samples
from services.gateway.errors import TENANT, bad_request, is_token, json_response, not_found, read_json
from services.gateway.graders import Graders
from services.gateway.lookups import fine_tuned_model, unanswered
from services.gateway.openai_map import BaseModel
from services.gateway.paging import limit_of, page, paged, unknown_after

RUN_FIELDS = {"dataset": "data_source.source", "adapter": "data_source.model", "version": "data_source.model"}


def order_of(request: web.Request, allowed: tuple[str, ...] = ("asc", "desc")) -> bool:
    """Whether the list is newest first (`order=desc`); OpenAI's eval lists default to asc."""
    order = request.query.get("order", "asc")
    if order not in allowed:
        raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", "order")
    return order == "desc"


def _run_name(body: dict[str, Any]) -> str:
    name = body.get("name", "")
    if not isinstance(name, str) or len(name) > 256:
        raise bad_request("name: a string of up to 256 characters", "name")
    return name


class Evals:
    def __init__(self, nc, models: dict[str, BaseModel], graders: Graders, spool_dir: str | None = None) -> None:
        self.nc, self.models, self.graders, self.spool_dir = nc, models, graders, spool_dir

    def routes(self) -> list[web.RouteDef]:
        base, run = "/v1/evals", "/v1/evals/{id}/runs/{run_id}"
        return [
            web.post(base, self.create),
            web.get(base, self.list_evals),
            web.get(base + "/{id}", self.retrieve),
            web.post(base + "/{id}", self.update),
            web.delete(base + "/{id}", self.delete),
            web.post(base + "/{id}/runs", self.create_run),
            web.get(base + "/{id}/runs", self.list_runs),
            web.get(run, self.retrieve_run),
            web.post(run + "/cancel", self.cancel_run),
            web.delete(run, self.delete_run),
            web.get(run + "/output_items", self.list_items),
            web.get(run + "/output_items/{item_id}", self.retrieve_item),
        ]

    async def _ask(self, tenant: str, verb: str, query, reply_type):
        return await bus.request(self.nc, getattr(names.evals_api(tenant), verb), query, reply_type | Error)

    async def _eval(self, tenant: str, ident: str) -> EvalDef:
        reply = await self._ask(tenant, "show", EvalQuery(name=ident), EvalReply) if is_token(ident) else None
        if isinstance(reply, Error) and reply.field != "name":
            raise unanswered(reply)
        if not isinstance(reply, EvalReply):
            raise not_found("eval", ident, "eval_id")
        return reply.eval

    async def _put(self, tenant: str, q: EvalCreate) -> web.Response:
        reply = await self._ask(tenant, "create", q, EvalReply)
        if isinstance(reply, Error):
            field = evals_map.native_field(reply.field or "")
            raise bad_request(f"{field}: {reply.error}" if field else reply.error, field or None)
        return json_response(evals_map.eval_object(reply.eval))

    async def create(self, request: web.Request) -> web.Response:
        body = await read_json(request, dict[str, Any])
        for field in ("data_source_config", "testing_criteria"):
            if field not in body:
                raise bad_request(f"{field}: missing required field", field)
        extra = set(body) - {"data_source_config", "testing_criteria", "name", "metadata"}
        if extra:
            raise bad_request(f"{sorted(extra)[0]}: unknown field of an eval", sorted(extra)[0])
        schema, sample = evals_map.data_source_config(body["data_source_config"])
        item_schema.check(schema)
        name = body.get("name", "")
        if not isinstance(name, str) or len(name) > 512:
            raise bad_request("name: a string of up to 512 characters", "name")
        criteria = evals_map.criteria(body["testing_criteria"])
        for n, c in enumerate(criteria):  # as /graders/validate checks each, its templates against the item_schema
            grader_door.against_schema(c.grader, f"testing_criteria[{n}]", schema)
        for n, c in enumerate(criteria):
            await grader_door.sources_load(self.graders, request[TENANT], c.grader, f"testing_criteria[{n}]")
        q = EvalCreate(
            name=f"eval_{secrets.token_hex(12)}",
            criteria=criteria,
            title=name,
            item_schema=schema,
            include_sample_schema=sample,
            metadata=evals_map.check_metadata(body.get("metadata")),
        )
        return await self._put(request[TENANT], q)

    async def update(self, request: web.Request) -> web.Response:
        tenant, body = request[TENANT], await read_json(request, dict[str, Any])
        e = await self._eval(tenant, request.match_info["id"])
        extra = set(body) - {"name", "metadata"}
        if extra:
            raise bad_request(f"{sorted(extra)[0]}: an eval's name and metadata are what change", sorted(extra)[0])
        name = body.get("name", e.title)
        if not isinstance(name, str) or len(name) > 512:
            raise bad_request("name: a string of up to 512 characters", "name")
        metadata = evals_map.check_metadata(body["metadata"]) if "metadata" in body else e.metadata
        q = EvalCreate(
            name=e.name,
            dataset=e.dataset,
            criteria=e.criteria,
            sampling=e.sampling,
            title=name,
            item_schema=e.item_schema,
            include_sample_schema=e.include_sample_schema,
            metadata=metadata,
            replace=True,
        )
        return await self._put(tenant, q)

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(evals_map.eval_object(await self._eval(request[TENANT], request.match_info["id"])))

    async def list_evals(self, request: web.Request) -> web.Response:
        tenant, limit, desc = request[TENANT], limit_of(request, 20), order_of(request)
        order_by = request.query.get("order_by", "created_at")
        if order_by not in ("created_at", "updated_at"):
            raise bad_request(f"order_by must be 'created_at' or 'updated_at', not {order_by!r}", "order_by")
        reply = await self._ask(tenant, "list", {}, EvalList)
        if isinstance(reply, Error):
            raise unanswered(reply)
        by = (
            (lambda e: (e.updated or e.created, e.name))
            if order_by == "updated_at"
            else (lambda e: (e.created, e.name))
        )
        shown = [evals_map.eval_object(e) for e in sorted(reply.evals, key=by, reverse=desc)]
        return json_response(page(shown, request.query.get("after"), limit, "eval of yours", lambda x: x["id"]))

    async def delete(self, request: web.Request) -> web.Response:
        tenant, ident = request[TENANT], request.match_info["id"]
        await self._eval(tenant, ident)
        runs = await self._runs(tenant, ident)
        reply = await self._ask(tenant, "delete", EvalQuery(name=ident), EvalReply)
        if isinstance(reply, Error):
            raise not_found("eval", ident, "eval_id")
        for r in runs:
            await self._drop_items(tenant, r)
        return json_response({"object": "eval.deleted", "deleted": True, "eval_id": ident})

    async def _drop_items(self, tenant: str, r: EvalRun) -> None:
        """The dataset the gateway stored a run's items in, deleted with the run (its job has ended or is cancelled)."""
        if r.dataset.startswith(eval_items.ITEMS_PREFIX):
            query = DatasetQuery(name=r.dataset, force=True)
            await bus.request(self.nc, names.datasets_api(tenant).delete, query, DatasetDeleted | Error)

    # --- runs --------------------------------------------------------------------------------------------------
    async def create_run(self, request: web.Request) -> web.Response:
        tenant, body = request[TENANT], await read_json(request, dict[str, Any])
        e = await self._eval(tenant, request.match_info["id"])
        extra = set(body) - {"data_source", "name", "metadata"}
        if extra:
            raise bad_request(f"{sorted(extra)[0]}: unknown field of a run", sorted(extra)[0])
        ds = body.get("data_source")
        if isinstance(ds, dict) and ds.get("type") == "jsonl":
            return await self._samples_run(tenant, e, ds, body)
        ds = eval_items.check_kind(ds)
        target = await self._target(tenant, ds["model"])
        settings = eval_items.sampling(ds.get("sampling_params"), e.sampling)
        name = _run_name(body)
        found = await eval_items.items(self.nc, tenant, ds.get("source"))
        await asyncio.to_thread(eval_items.check_schema, found, e.item_schema, ds["source"])
        rows = eval_items.rows(found, ds.get("input_messages"))
        dataset = await eval_items.store_rows(self.nc, tenant, rows, e.name, self.spool_dir)
        q = RunRequest(
            eval=e.name,
            **target,
            dataset=dataset,
            name=name,
            metadata=evals_map.check_metadata(body.get("metadata")),
            source=ds,
            sampling=settings,
        )
        reply = await self._ask(tenant, "run", q, RunReply)
        if isinstance(reply, Error):
            await self._drop_items(tenant, EvalRun(id="-", eval=e.name, job="-", base_model="-", dataset=dataset))
            field = RUN_FIELDS.get(reply.field or "", "data_source.model")
            raise bad_request(f"{field}: {reply.error}", field)
        return json_response(evals_map.run_object(reply.run))

    async def _samples_run(self, tenant: str, e: EvalDef, ds: dict[str, Any], body: dict[str, Any]) -> web.Response:
        """A `jsonl` run: its rows' samples, checked here, graded by the evals service as sent (nothing sampled)."""
        source = eval_samples.check(ds)
        found = await eval_samples.rows(self.nc, tenant, source)
        rows = await asyncio.to_thread(eval_samples.sampled, found, e.item_schema, source)
        q = RunRequest(
            eval=e.name,
            base_dir="",
            name=_run_name(body),
            metadata=evals_map.check_metadata(body.get("metadata")),
            source=ds,
            samples=rows,
        )
        try:
            reply = await self._ask(tenant, "run", q, RunReply)
        except bus.PayloadTooLarge as err:
            raise bad_request(
                f"data_source.source: the rows come to {err.size / 2**20:.1f} MiB with their samples, over the "
                f"{err.limit / 2**20:.1f} MiB a run's request may carry here: split them across runs",
                "data_source.source",
            ) from None
        if isinstance(reply, Error):
            field = evals_map.native_field(reply.field or "")
            field = field if field.startswith("testing_criteria") else "data_source.source"
            raise bad_request(f"{field}: {reply.error}", field)
        return json_response(evals_map.run_object(reply.run))

    async def _target(self, tenant: str, model: str) -> dict[str, Any]:
        """The RunRequest's model fields: a base model the gateway offers, or the tenant's fine-tuned model."""
        if model in self.models:
            m = self.models[model]
            return {"base_model": m.name, "base_dir": m.base_dir, "accelerator": m.accelerator}
        found = await fine_tuned_model(self.nc, tenant, model)
        if found is not None and found[1].base_model in self.models:
            m = self.models[found[1].base_model]
            return {"adapter": model, "version": found[1].version, "base_dir": m.base_dir, "accelerator": m.accelerator}
        raise bad_request(
            f"data_source.model: {model!r} is neither a base model of this fleet nor a fine-tuned model of yours; "
            "GET /v1/models lists them",
            "data_source.model",
            "model_not_available",
        )

    async def _runs(self, tenant: str, ident: str) -> list[EvalRun]:
        reply = await self._ask(tenant, "runs", RunListQuery(eval=ident), RunList)
        if isinstance(reply, Error):
            raise unanswered(reply)
        return reply.runs

    async def _run(self, request: web.Request) -> EvalRun:
        tenant, ident, run = request[TENANT], request.match_info["id"], request.match_info["run_id"]
        reply = await self._ask(tenant, "run_show", RunQuery(run=run), RunReply) if is_token(run) else None
        if not isinstance(reply, RunReply) or reply.run.eval != ident:
            raise evals_map.unknown_run(run)
        return reply.run

    async def list_runs(self, request: web.Request) -> web.Response:
        tenant, limit, desc = request[TENANT], limit_of(request, 20), order_of(request)
        ident, status = request.match_info["id"], request.query.get("status")
        await self._eval(tenant, ident)
        runs = sorted(await self._runs(tenant, ident), key=lambda r: (r.created, r.id), reverse=desc)
        shown = [evals_map.run_object(r) for r in runs if status is None or r.state == status]
        return json_response(page(shown, request.query.get("after"), limit, "run of this eval", lambda x: x["id"]))

    async def retrieve_run(self, request: web.Request) -> web.Response:
        return json_response(evals_map.run_object(await self._run(request)))

    async def cancel_run(self, request: web.Request) -> web.Response:
        run = await self._run(request)
        reply = await self._ask(request[TENANT], "run_cancel", RunQuery(run=run.id), RunReply)
        if isinstance(reply, Error):
            raise evals_map.unknown_run(run.id)
        return json_response(evals_map.run_object(reply.run))

    async def delete_run(self, request: web.Request) -> web.Response:
        run = await self._run(request)
        reply = await self._ask(request[TENANT], "run_delete", RunQuery(run=run.id), RunReply)
        if isinstance(reply, Error):
            raise evals_map.unknown_run(run.id)
        await self._drop_items(request[TENANT], run)
        return json_response({"object": "eval.run.deleted", "deleted": True, "run_id": run.id})

    # --- output items ------------------------------------------------------------------------------------------
    async def list_items(self, request: web.Request) -> web.Response:
        """A page of the run's output items, reading only that page of them (evals/output_items.py)."""
        tenant, limit, desc = request[TENANT], limit_of(request, 20), order_of(request)
        status, after = request.query.get("status"), request.query.get("after")
        if status not in (None, "pass", "fail"):
            raise bad_request(f"status must be 'pass' or 'fail', not {status!r}", "status")
        run = await self._run(request)
        start = evals_map.index_of(run.id, after) if after else None
        if after and start is None:
            raise unknown_after(after, "output item of this run")

        async def ask(after_index: int, most: int) -> tuple[list, bool]:
            query = ItemsQuery(run=run.id, after=after_index, limit=most)
            reply = await self._ask(tenant, "items", query, ItemsPage)
            if isinstance(reply, Error):
                raise evals_map.unknown_run(run.id)
            return reply.items, reply.has_more

        shown, more = await output_items.page(ask, run, start, limit, desc, status)
        return json_response(paged(shown, more, lambda x: x["id"]))

    async def retrieve_item(self, request: web.Request) -> web.Response:
        run, ident = await self._run(request), request.match_info["item_id"]
        index = evals_map.index_of(run.id, ident)
        if index is not None:
            page_ = await self._ask(
                request[TENANT], "items", ItemsQuery(run=run.id, after=index - 1, limit=1), ItemsPage
            )
            if isinstance(page_, ItemsPage) and page_.items and page_.items[0].index == index:
                return json_response(evals_map.output_item(run, page_.items[0]))
        raise not_found("eval run output item", ident, "output_item_id")
