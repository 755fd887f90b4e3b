"""What a model grader may make the judge host do, against real local HTTP servers (services/graders/judge.py): an
input_image URL that is not data: is refused (at check() where it is written out, per sample where a template
renders it) unless the operator named its host, and the judge is never asked; a redirect is not followed, so the
judge's key never reaches the other host; a failure's body reaches the operator's log under a request id and the
tenant sees only a fixed message with that id; a cancelled call ends at once, on the loop, no thread left."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from aiohttp import web

from schemas.graders import Sample
from services.cli.grader_flags import image_hosts
from services.graders import GraderContext, check, grade_many_async
from tests.test_graders import SCORE, Judge, grader

PIXEL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


def with_image(url: str) -> dict:
    content = [
        {"type": "input_text", "text": "Score {{sample.output_text}}"},
        {"type": "input_image", "image_url": url},
    ]
    return {**SCORE, "input": [{"role": "user", "content": content}]}


class Server:
    """A real HTTP server answering every POST and GET with `answer(request)`; it records what it was sent."""

    def __init__(self, answer) -> None:
        self.answer, self.seen = answer, []

    async def __aenter__(self) -> str:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.seen.append((request.method, request.path, request.headers.get("Authorization")))
            return await self.answer(request)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def grade(raw: dict, ctx: GraderContext, item: dict | None = None, output: str = "Paris"):
    [result] = await grade_many_async(grader(raw), [Sample.from_model_sample(output)], [item or {}], ctx)
    return result


async def test_an_image_url_the_judge_would_fetch_is_refused_unless_its_host_is_named():
    judge = Judge(lambda body: (200, json.dumps({"result": 5}), None))
    async with judge as url:
        ctx = GraderContext(judge_url=url, judge_image_hosts=image_hosts("Images.Example.org, cdn.example.org"))
        where = "grader.input[0].content[1].image_url"
        for refused in (
            "http://169.254.169.254/latest/meta-data/",
            "file:///etc/passwd",
            "https://images.example.org@169.254.169.254/x.png",  # a user part: the host is the other one
            "https://169.254.169.254\\@images.example.org/x.png",  # read two ways by two URL parsers
            "gopher://images.example.org/x",
        ):
            errors = {e.field: e.reason for e in check(grader(with_image(refused)), "grader", ctx)}
            assert "data: URL" in errors.get(where, "") and "--judge-image-hosts" in errors[where], (refused, errors)
        for allowed in (PIXEL, "https://images.example.org/cat.png", "http://cdn.example.org/a/b.jpg?x=1"):
            assert check(grader(with_image(allowed)), "grader", ctx) == [], allowed
        assert check(grader(with_image("{{item.image}}")), "grader", ctx) == []  # a template: checked as rendered

        sent = await grade(with_image("{{item.image}}"), ctx, {"image": "http://10.0.0.1/internal.png"})
        assert sent.score == 0.0 and "data: URL" in sent.error and judge.requests == [], sent  # never asked
        fine = await grade(with_image("{{item.image}}"), ctx, {"image": PIXEL})
        assert fine.score == 5.0 and fine.error == "", fine
        [(_, body)] = judge.requests
        assert body["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": PIXEL}}


@pytest.mark.parametrize("status", [302, 307, 308])  # urllib followed a 302 as a GET, Authorization and all
async def test_a_redirect_is_not_followed_and_the_key_never_reaches_the_other_host(caplog, status):
    async def collect(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": '{"result": 9}'}}]})

    other = Server(collect)
    async with other as elsewhere:

        async def moved(request: web.Request) -> web.Response:
            return web.Response(status=status, headers={"Location": f"{elsewhere}/v1/chat/completions"})

        async with Server(moved) as judge:
            ctx = GraderContext(judge_url=f"{judge}/v1", judge_api_key="sk-judge-secret")
            with caplog.at_level(logging.WARNING, logger="services.graders.judge"):
                result = await grade(SCORE, ctx, {"question": "q"})
    assert other.seen == [], other.seen
    assert result.score == 0.0 and result.error_kind == "model_grader_server_error", result
    rid = result.error.split("request id ")[1].split(")")[0]
    logged = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert logged and f"HTTP {status}" in logged[0] and "not followed" in logged[0] and elsewhere in logged[0], logged


async def test_the_judges_error_body_goes_to_the_operators_log_and_the_tenant_sees_a_request_id(caplog):
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="upstream 10.1.2.3:8443 refused: internal detail")

    async with Server(broken) as judge:
        with caplog.at_level(logging.WARNING, logger="services.graders.judge"):
            result = await grade(SCORE, GraderContext(judge_url=judge), {"question": "q"})
    assert result.score == 0.0 and result.error_kind == "model_grader_server_error", result
    assert "internal detail" not in result.error and "10.1.2.3" not in result.error and "HTTP" not in result.error
    assert result.error.startswith("the judge engine gave no answer (request id judge-"), result.error
    rid = result.error.split("request id ")[1].split(")")[0]
    [logged] = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert "HTTP 500" in logged and "upstream 10.1.2.3:8443 refused: internal detail" in logged, logged


async def test_a_cancelled_call_to_a_judge_that_never_answers_ends_at_once_without_a_thread():
    asked, released = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        asked.set()
        await released.wait()  # no answer while the call waits
        return web.Response(status=503)

    async with Server(hang) as judge:
        threads = threading.active_count()
        task = asyncio.create_task(grade(SCORE, GraderContext(judge_url=judge), {"question": "q"}))
        await asyncio.wait_for(asked.wait(), 10)
        assert threading.active_count() <= threads  # the request is on the loop, not in a thread
        task.cancel()
        began = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - began < 1.0
        released.set()  # lets the server stop
