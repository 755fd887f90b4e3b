"""/v1/models: the base models the gateway offers and the tenant's fine-tuned models (registered adapters that
serve a version), as OpenAI's Model objects; DELETE retires a fine-tuned model through the adapter registry, so the
fleet's engines unload it. Another tenant's model is not there (404)."""

from __future__ import annotations

from aiohttp import web

from schemas import names
from schemas.gateway import ModelDeleted, ModelObject, Page
from schemas.jobs import Error
from schemas.registry import AdapterList, AdapterListQuery, AdapterReply, AliasRequest
from services import bus
from services.gateway.errors import TENANT, OpenAIError, json_response
from services.gateway.lookups import fine_tuned_model, served_version
from services.gateway.openai_map import BaseModel
from services.gateway.terms import openai_terms

OWNER = "jetlora"  # the base models' owned_by; a fine-tuned model's is its tenant


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model '{name}' does not exist or is not yours; GET /v1/models lists yours.",
        "model",
        "model_not_found",
    )


class Models:
    def __init__(self, nc, models: dict[str, BaseModel]) -> None:
        self.nc, self.models = nc, models

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.list),
            web.get("/v1/models/{id}", self.retrieve),
            web.delete("/v1/models/{id}", self.delete),
        ]

    def _bases(self) -> list[ModelObject]:
        return [ModelObject(id=m.name, created=0, owned_by=OWNER) for m in self.models.values()]

    async def list(self, request: web.Request) -> web.Response:
        tenant = request[TENANT]
        reply = await bus.request(self.nc, names.ADAPTERS.list, AdapterListQuery(), AdapterList)
        tuned = [
            ModelObject(id=a.alias.name, created=int(version.created), owned_by=tenant)
            for a in reply.adapters
            if (version := served_version(a, tenant)) is not None
        ]
        return json_response(Page(data=self._bases() + sorted(tuned, key=lambda m: (-m.created, m.id))))

    async def retrieve(self, request: web.Request) -> web.Response:
        tenant, name = request[TENANT], request.match_info["id"]
        if name in self.models:
            return json_response(ModelObject(id=name, created=0, owned_by=OWNER))
        found = await fine_tuned_model(self.nc, tenant, name)
        if found is None:
            raise model_not_found(name)
        return json_response(ModelObject(id=name, created=int(found[1].created), owned_by=tenant))

    async def delete(self, request: web.Request) -> web.Response:
        """Retire the tenant's fine-tuned model: the registry's alias serves none, engines unload it, and it leaves
        the list (its versions stay in the registry, as OpenAI keeps the job that made it)."""
        tenant, name = request[TENANT], request.match_info["id"]
        if name in self.models:
            raise OpenAIError(
                403,
                f"'{name}' is a base model of this fleet; only fine-tuned models are deleted",
                "model",
                "model_not_deletable",
            )
        found = await fine_tuned_model(self.nc, tenant, name)
        if found is None:
            raise model_not_found(name)
        query = AliasRequest(name=name, expect_changes=found[0].alias.changes)  # only what was looked at
        reply = await bus.request(self.nc, names.ADAPTERS.retire, query, AdapterReply | Error)
        if isinstance(reply, Error):  # it changed meanwhile (a promote, a rollback): ask again
            raise OpenAIError(409, openai_terms(reply.error), "model", "model_changed")
        return json_response(ModelDeleted(id=name))
