"""The middleware every gateway request goes through: the tenant from the request's key (a /v1 request's only
tenant), every refusal in OpenAI's error shape, and the request's id in each answer (`x-request-id`), the one a
fault no handler foresaw is logged under (faults.py) and a Tinker fault's body names (request[REQUEST_ID])."""

from __future__ import annotations

import logging

from aiohttp import web

from services.bus import RequestError
from services.gateway.errors import TENANT, OpenAIError, error_response, too_large
from services.gateway.faults import REQUEST_ID_HEADER, Faults, request_id, unforeseen
from services.gateway.keys import KeyStore

log = logging.getLogger(__name__)
REQUEST_ID = web.RequestKey("request_id", str)  # the request's one id: its header, and any fault's body and log


def openai_errors(keys: KeyStore, faults: Faults):
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        ident = request[REQUEST_ID] = request_id()
        response = await _answer(request, handler, ident, keys, faults)
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = ident
        return response

    return middleware


async def _answer(request: web.Request, handler, ident: str, keys: KeyStore, faults: Faults) -> web.StreamResponse:
    try:
        if request.path.startswith("/v1/"):
            request[TENANT] = await _tenant(request, keys)
        return await handler(request)
    except OpenAIError as e:
        return error_response(e)
    except RequestError as e:  # a service did not answer: ours, not the client's
        log.warning("%s %s: %s", request.method, request.path, e)
        return error_response(OpenAIError(503, f"{e}", None, "service_unavailable", "server_error"))
    except web.HTTPRequestEntityTooLarge:
        return error_response(too_large())
    except ConnectionResetError:  # the client went away mid-body: nobody reads this, nothing to log loudly
        log.info("%s %s: the client went away before the body ended", request.method, request.path)
        return error_response(OpenAIError(400, "the request ended before its body did; send it again"))
    except web.HTTPException as e:
        return error_response(OpenAIError(e.status, e.reason, None, None))
    except Exception:  # a fault of ours that no handler foresaw: OpenAI's shape, logged with its request id
        return error_response(unforeseen(request, ident, faults))


async def _tenant(request: web.Request, keys: KeyStore) -> str:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    key = key.strip().removeprefix("tml-")  # a Tinker key opens /v1 too (the tinker:// completions take it)
    tenant = await keys.tenant_of(key) if scheme.lower() == "bearer" else None
    if tenant is None:
        raise OpenAIError(
            401,
            "Incorrect API key provided. Keys are made with `jetlora keys create --tenant T`.",
            None,
            "invalid_api_key",
        )
    return tenant
