"""Every Tinker route given 500 malformed requests (bodies of the wrong shape, wrong types, numbers out of range or
not finite, protobuf with torn byte lengths, ids that are none of the caller's): every one is a 4xx naming what is
wrong (no 5xx at all), the gateway's memory stays flat, a malformed call that names its model and seq_id still takes
its turn, and the session answers afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import pytest

from services.gateway.app import Gateway
from services.gateway.openai_map import BaseModel
from services.gateway.tinker import proto
from services.gateway.tinker.outcomes import STEP_METRIC
from services.gateway.tinker.settings import TinkerSettings
from tests.conftest import wait_nodes
from tests.test_tinker_api import key_for
from tests.test_tinker_bounds import Api

pytestmark = pytest.mark.timeout(300)
os.environ.setdefault("TINKER_TELEMETRY", "0")
PER_ROUTE = int(os.environ.get("FUZZ_PER_ROUTE", 500))
WARM = PER_ROUTE // 10
JUNK = [None, True, 3.5, -1, 0, 10**30, "", "x" * 5000, "../../etc/passwd", "é\u0000", [], {}, [1, "a"], {"a": 1},
        "NaN", 2**63, -(2**70)]  # fmt: skip
NUMBERS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1",
    "0",
    '"x"',
    "true",
    "null",
    "[]",
    "1e-400",
    "99999999999999999999",
]
BROKEN = {  # raw JSON that no call takes in each field
    "adam_params": NUMBERS[:4]
    + [
        '"x"',
        "[]",
        '{"learning_rate": "x"}',
        '{"learning_rate": NaN}',
        '{"weight_decay": Infinity}',
        '{"beta1": 1.5}',
        '{"eps": 0}',
        '{"lr": 1}',
    ],
    "path": ['"../a"', "5", "[]", "NaN", '"a/b"', '""', '"' + "y" * 200 + '"', '"tinker://x/weights/y"', "true"],
    "ttl_seconds": ['"x"', "-5", "NaN", "1e400", "1.5", "5", "99999999999999", "[]"],
}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Cases:
    """Malformed requests for each route; `seq()` hands out the fuzzed model's next turn, so every call that names
    it rightly takes the turn after the last (none is left waiting for the gap timeout)."""

    def __init__(self, rng: random.Random, model: str, session: str, sampler: str) -> None:
        self.rng, self.model, self.session, self.sampler, self.next = rng, model, session, sampler, 1
        self.taken = 0  # turns the malformed calls took

    def seq(self) -> int:
        self.next, self.taken = self.next + 1, self.taken + 1
        return self.next - 1

    def junk(self):
        return self.rng.choice(JUNK)

    def raw(self, template: dict, broken: str, value: str) -> bytes:
        """The template as JSON with one field's value replaced by raw text (NaN, 1e400 and such)."""
        return json.dumps({**template, broken: "@@"}).replace('"@@"', value).encode()

    def body(self, template: dict, fields: list[str]) -> bytes:
        r = self.rng.random()
        if r < 0.1:
            return self.rng.choice([b"", b"{", b"[1, 2]", b"\xff\xfe", b'"a"', b"null", b"{}" * 1000])
        if r < 0.4:
            return self.raw(template, self.rng.choice(fields), self.rng.choice(NUMBERS))
        broken = {**template}
        for name in self.rng.sample(fields, k=self.rng.randint(1, len(fields))):
            broken[name] = self.junk()
        return json.dumps(broken).encode()

    def ordered(self, extra: dict, fields: list[str]) -> bytes:
        """A call on the fuzzed model: its envelope broken (nothing taken), or its turn taken by a broken rest."""
        if self.rng.random() < 0.3 or not fields:
            bad = self.rng.choice([{"model_id": self.junk()}, {"seq_id": self.junk()}, {"seq_id": 10**6},
                                   {"model_id": self.model + "x"}])  # fmt: skip
            return json.dumps({"model_id": self.model, "seq_id": 10**6, **extra, **bad}).encode()
        name = self.rng.choice(fields)
        value = self.rng.choice(BROKEN[name])
        return self.raw({"model_id": self.model, "seq_id": self.seq(), **extra}, name, value)

    def forward_backward(self) -> bytes:
        req = proto.ForwardBackwardRequest(model_id=self.model, loss_fn="cross_entropy")
        r = self.rng.random()
        if r < 0.15:
            return bytes(self.rng.getrandbits(8) for _ in range(self.rng.randint(0, 64)))
        if r < 0.3:
            req.seq_id = self.rng.choice([-1, 10**6, 0])
            return req.SerializeToString()
        req.seq_id = self.seq()
        datum = req.data.add()
        chunk = datum.model_input.add()
        tokens = self.rng.choice([b"\x01\x00\x00", b"\x01\x00\x00\x00\x02", b"\xff\xff\xff\xff", b""])
        chunk.encoded_text.tokens = tokens if tokens else b"\x01\x00\x00\x00"
        target = datum.loss_fn_inputs["target_tokens"]
        target.dtype = self.rng.choice([proto.DTYPE_FLOAT32, proto.DTYPE_INT64, 9])
        target.dense = self.rng.choice([b"\x00\x00\xc0\x7f", b"\x01", b"\x00\x00\x80\x7f", b"\x00" * 7])
        if not tokens:  # torn bytes elsewhere: an unknown loss, or a datum's input of the wrong shape
            target.shape.extend([1, 2])
            req.loss_fn = self.rng.choice(["", "mse", "custom", "x" * 300])
        return req.SerializeToString()

    def sample(self) -> bytes:
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
        template = {"sampling_session_id": self.sampler, "num_samples": 1, "prompt": prompt,
                    "sampling_params": {"max_tokens": 2}}  # fmt: skip
        broken = self.rng.choice([
            {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [self.rng.choice(JUNK[1:4] + JUNK[5:])]}]}},
            {"prompt": {"chunks": [{"type": "image", "data": "x"}]}},
            {"prompt": {"chunks": self.junk()}},
            {"sampling_params": {"stop": self.rng.choice([7, [1, "a"], {"a": 1}, 3.5])}},
            {"sampling_params": {self.rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed"]):
                                 self.rng.choice([-5, 0, 10**9, "x", 1.5, 2**70, [1]])}},
            {"num_samples": self.rng.choice([0, -1, 10**6, "2", 1.5])},
            {"topk_prompt_logprobs": 5},
            {"sampling_session_id": self.junk()},
        ])  # fmt: skip
        if self.rng.random() < 0.2:
            return self.raw(template, "sampling_params", '{"temperature": ' + self.rng.choice(NUMBERS[:4]) + "}")
        return json.dumps({**template, **broken}).encode()

    def requests(self, count: int) -> dict[str, list[tuple[str, str, bytes, str]]]:
        """Route -> (method, path, body, content type) x count, to be sent in this order."""
        s, m = self.session, self.model
        posts = {
            "client/config": lambda: self.body({}, ["x"]),
            "client/dynamic_config": lambda: self.body({}, ["x"]),
            "telemetry": lambda: self.body({"events": []}, ["events"]),
            "create_session": lambda: self.body({"tags": [], "user_metadata": {"a": "b"}}, ["tags", "user_metadata"]),
            "session_heartbeat": lambda: self.body({"session_id": "sess-0"}, ["session_id"]),
            "get_info": lambda: self.body({"model_id": m + "y"}, ["model_id"]),
            "retrieve_future": lambda: self.body({"request_id": f"{m}:999"}, ["request_id"]),
            "create_model": lambda: self.body(
                {"session_id": s, "base_model": "none", "model_seq_id": 50, "lora_config": {"rank": 0}},
                ["session_id", "model_seq_id", "lora_config", "optimizer_config"],
            ),  # fmt: skip
            "optim_step": lambda: self.ordered({"adam_params": {}}, ["adam_params"]),
            "save_weights": lambda: self.ordered({"path": "x"}, ["path", "ttl_seconds"]),
            "save_weights_for_sampler": lambda: self.ordered({"path": "x"}, ["path", "ttl_seconds"]),
            "load_weights": lambda: self.ordered({"path": "x"}, ["path"]),
            "create_sampling_session": lambda: self.body(
                {"session_id": s, "model_path": "tinker://a/b/c", "base_model": "none"}, ["session_id", "model_path"]
            ),  # fmt: skip
            "asample": self.sample,
            "sessions/{junk}/finish": lambda: b"{}",
        }
        out: dict[str, list] = {}
        for route, make in posts.items():
            out[route] = []
            for _ in range(count):
                path = route.replace("{junk}", self._id())
                out[route].append(("POST", path, make(), "application/json"))
        out["forward_backward"] = [
            ("POST", "forward_backward", self.forward_backward(), proto.CONTENT_TYPE) for _ in range(count)
        ]
        gets = ["get_server_capabilities", "samplers/{id}", "training_runs?limit={q}", "training_runs/{id}",
                "training_runs/{id}/checkpoints", "sessions?offset={q}", "sessions/{id}"]  # fmt: skip
        for route in gets:
            out[route] = [("GET", route.replace("{id}", self._id()).replace("{q}", self._query()), b"", "")
                          for _ in range(count)]  # fmt: skip
        for method, route in (("DELETE", "training_runs/{id}/checkpoints/{kind}/{name}"),
                              ("PUT", "training_runs/{id}/checkpoints/{kind}/{name}/ttl")):  # fmt: skip
            out[f"{method} {route}"] = [
                (method, route.replace("{id}", self.rng.choice([m, self._id()])).replace("{kind}", self.rng.choice(
                    ["weights", "sampler_weights", "x"])).replace("{name}", self._id()),
                 self.body({"ttl_seconds": 3600}, ["ttl_seconds"]), "application/json")
                for _ in range(count)
            ]  # fmt: skip
        return out

    def _id(self) -> str:
        return self.rng.choice(["x", "%2e%2e", "a" * 300, "sess-1:train:0", "..", "a.b", "%00", "-", "é", "1:2:3"])

    def _query(self) -> str:
        return self.rng.choice(["-1", "x", "0", "99999999999", "1.5", "%00"])


async def fuzz(api: Api, requests: list[tuple[str, str, bytes, str]], statuses: Counter, parallel: int = 8) -> None:
    gate = asyncio.Semaphore(parallel)

    async def one(method: str, path: str, data: bytes, kind: str) -> None:
        async with gate:
            headers = {"Content-Type": kind} if kind else {}
            async with api.http.request(method, f"{api.url}/{path}", data=data, headers=headers) as r:
                text = await r.text()
                statuses[r.status] += 1
                assert r.status < 500, (method, path, data[:200], r.status, text[:500])
                if r.status >= 400:
                    assert json.loads(text)["detail"], text

    await asyncio.gather(*(one(*request) for request in requests))


async def test_every_route_answers_malformed_requests_with_a_4xx_and_the_session_goes_on(nc, stack, tiny_model, agents):
    agents.start("box", gpus=None, offer_cpu=True, trainer=None, interval=0.25)
    await wait_nodes(nc, 1)
    gw = Gateway(nc, {"tiny": BaseModel("tiny", str(tiny_model), accelerator="cpu")}, port=0,
                 tinker_settings=TinkerSettings(gap_s=2.0))  # fmt: skip
    await gw.start()
    try:
        async with Api(gw, await key_for(nc, "acme")) as api:
            session = (await api.ok("create_session", {}))["session_id"]
            model = await api.model(session)
            await api.result(f"{model}:0", timeout=120)
            saved = await api.ok("save_weights_for_sampler", {"model_id": model, "seq_id": 1, "path": "s"})
            path = (await api.result(saved["request_id"]))["path"]
            sampler = await api.ok("create_sampling_session", {"session_id": session, "model_path": path})
            cases = Cases(random.Random(57), model, session, sampler["sampling_session_id"])
            cases.next = 2
            statuses: Counter = Counter()
            started = time.monotonic()
            for requests in cases.requests(WARM).values():  # what grows once (buffers, caches) grows here
                await fuzz(api, requests, statuses)
            before = rss_mib()
            routes = cases.requests(PER_ROUTE - WARM)
            for requests in routes.values():
                await fuzz(api, requests, statuses)
            grew = rss_mib() - before
            print(f"{sum(statuses.values())} requests on {len(routes)} routes in {time.monotonic() - started:.1f} s: "
                  f"{dict(statuses)}; RSS {before:.0f} MiB, +{grew:.1f} MiB; {cases.taken} malformed calls took "
                  "their turn")  # fmt: skip
            assert grew < 24, grew
            turn = await api.ok("optim_step", {"model_id": model, "seq_id": cases.next, "adam_params": {}})
            stepped = await api.result(turn["request_id"])
            assert stepped["metrics"][STEP_METRIC] == 1.0  # the turns before it were taken
            sample = {"sampling_session_id": sampler["sampling_session_id"], "num_samples": 2,
                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}}  # fmt: skip
            sampled = await api.ok("asample", sample)
            async with api.http.post(f"{api.url}/retrieve_future", json={"request_id": sampled["request_id"]}) as r:
                assert r.status == 200 and r.content_type == proto.CONTENT_TYPE  # the sampler answers too
            await api.ok(f"sessions/{session}/finish", {})
    finally:
        await gw.close()
