"""A Tinker client sends four requests a training step (two calls, two fetches), and each read its key's record from
the store, a NATS round trip on the step's path (#64). The gateway now believes a key the store confirmed for
KEY_BELIEVED_S: one read a window however many requests, an unknown key refused at once (nothing is believed of
it), and a deleted key refused within the window. Real NATS, real HTTP."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from services.gateway.keys import KeyStore, new_key
from services.gateway.tinker.http import KEY_BELIEVED_S, TinkerRefusal, tenant_of
from tests.conftest import wait_for


class CountedKeys(KeyStore):
    """The real key store, counting its reads."""

    reads = 0

    async def tenant_of(self, key: str) -> str | None:
        self.reads += 1
        return await super().tenant_of(key)


async def serving(keys: KeyStore) -> TestServer:
    async def whoami(request: web.Request) -> web.Response:
        try:
            return web.json_response({"tenant": await tenant_of(request, keys)})
        except TinkerRefusal as e:
            return web.json_response({"detail": e.detail}, status=e.status)

    app = web.Application()
    app.router.add_get("/whoami", whoami)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_a_key_is_read_once_a_window_and_a_deleted_key_stops_within_it(nc):
    keys = CountedKeys((await KeyStore.open(nc.jetstream())).kv)
    key, record = new_key("acme")
    await keys.put(record)
    server = await serving(keys)
    try:
        async with aiohttp.ClientSession() as http:

            async def ask(presented: str) -> int:
                async with http.get(server.make_url("/whoami"), headers={"X-API-Key": presented}) as r:
                    if r.status == 200:
                        assert (await r.json())["tenant"] == "acme"
                    return r.status

            start = time.monotonic()
            statuses = [await ask("tml-" + key) for _ in range(20)]
            if time.monotonic() - start < KEY_BELIEVED_S:  # all within one window: one read of the store
                assert keys.reads == 1, keys.reads
            assert statuses == [200] * 20

            before = keys.reads
            wrong = key[:-1] + ("A" if key[-1] != "A" else "B")
            assert [await ask("tml-" + wrong) for _ in range(3)] == [401] * 3  # a wrong secret: each one read
            assert keys.reads == before + 3

            assert await keys.delete(record.id)
            deleted = time.monotonic()
            await wait_for(lambda: _refused(ask, key), timeout=KEY_BELIEVED_S + 5, what="the deleted key refused")
            assert time.monotonic() - deleted < KEY_BELIEVED_S + 1.0
    finally:
        await server.close()


async def _refused(ask, key: str) -> bool:
    return await ask("tml-" + key) == 401
