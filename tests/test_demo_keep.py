"""`jetlora demo --keep`, run as a user runs it: after the run the whole stack stays up (scheduler, agent, adapter
registry, evals service, artifact service, dashboard, nats-server), so the page it points to shows the job, the node
up and no error, in a real headless Chromium; SIGTERM ends it all. And the rule by which the demo's table, `jetlora
watch` and the page show a base model's answer: as it is when it is text, else '(no answer yet: random weights)'."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import nats
import pytest

from schemas import names
from schemas.evals import RunList
from schemas.events import Sample, Samples
from schemas.job_status import JobList
from schemas.nodes import NodeList
from schemas.registry import AdapterList
from services import bus
from services.cli.printable import NO_ANSWER, base_answer, readable
from services.cli.watch import samples_lines
from tests.conftest import ROOT, wait_for
from tests.test_dashboard import CHROMIUM, FLAGS, needs_browser

RANDOM_BYTES = "m\ufffd\ufffd P\x7f\x05pal\ufffds\ufffd\x03apan\ufffd\\"  # what the demo's untrained base said


def test_a_base_answer_is_shown_as_text_or_said_to_be_none():
    assert not readable(RANDOM_BYTES) and base_answer(RANDOM_BYTES) == NO_ANSWER
    assert base_answer(" Paris.\n") == "Paris." and readable("Paris\tis\nthe capital")
    assert readable("Tōkyō 東京\ufffd")  # a character cut at the end by the token budget is no reason
    assert not readable("\ufffd\ufffd") and readable("")  # only cut bytes is none; nothing at all is said as is
    assert not readable("Paris\x1b[2J") and not readable("a\u202eb")  # escapes and bidi overrides are not text
    lines = samples_lines(Samples(step=0, model="base", samples=[Sample("Q?", RANDOM_BYTES), Sample("R?", "Rome")]))
    assert NO_ANSWER in lines and "'Rome'" in lines and "\ufffd" not in lines
    adapter = samples_lines(Samples(step=4, model="adapter", samples=[Sample("Q?", "Pa\x05ris")]))
    assert "'Pa\\x05ris'" in adapter  # an adapter's answer as it is, escaped


@needs_browser
@pytest.mark.timeout(300)
async def test_demo_keep_keeps_the_whole_stack_up_and_the_page_free_of_errors(tmp_path):
    from playwright.async_api import async_playwright

    cmd = [sys.executable, "-m", "services.cli", "demo", "--out", str(tmp_path / "out"), "--steps", "10", "--keep"]
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    said: list[str] = []
    reading = asyncio.create_task(_read(proc, said))
    try:
        await _until(said, "Dashboard:", proc, timeout=240)
        output = "".join(said)
        url = re.search(r"embedded NATS at (nats://\S+)", output).group(1)
        page_url = re.search(r"Dashboard:\s+(http://\S+)", output).group(1)
        base_lines = [line for line in said if "[base model]" in line or "│ trained" in line or "│ held out" in line]
        assert base_lines and all(NO_ANSWER in line for line in base_lines), base_lines  # watch's lines, the table
        nc = await nats.connect(url)
        try:  # every service answers after the run

            async def states() -> list[str]:  # the scheduler applies the job's last state a moment after watch saw it
                states = [j.state for j in (await bus.request(nc, names.LIST_JOBS, b"{}", JobList)).jobs]
                return states if states == ["succeeded"] else []

            await wait_for(states, timeout=30, what="the scheduler to list the demo's job succeeded")
            nodes = (await bus.request(nc, names.LIST_NODES, b"{}", NodeList)).nodes
            assert [(n.node, n.alive) for n in nodes] == [("demo-node", True)], nodes
            assert isinstance(await bus.request(nc, names.ADAPTERS.list, b"{}", AdapterList), AdapterList)
            assert isinstance(await bus.request(nc, names.evals_api().runs, b"{}", RunList), RunList)
        finally:
            await nc.close()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = await browser.new_page()
            await page.goto(page_url)
            await page.wait_for_function(
                "document.querySelector('#nodes').textContent.includes('demo-node')"
                " && document.querySelector('#jobs').textContent.includes('succeeded')"
                " && document.querySelector('#adapters').textContent.includes('none registered')"
                " && document.querySelector('#runs').textContent.includes('no eval runs')"
                " && document.querySelector('#samples').textContent.includes('base model')",
                timeout=30_000,
            )
            await asyncio.sleep(3)  # a few polls and heartbeats later, still nothing wrong
            text = await page.inner_text("body")
            status = await page.text_content("#status")
            base = await page.evaluate(
                "[...document.querySelectorAll('#samples tr')].slice(1).map(r => r.cells[1].textContent)"
            )
            await browser.close()
        assert status.startswith("connected") and "·" not in status, status
        for wrong in ("timeout", "no responders", "silent", "-1 CPU"):
            assert wrong not in text, (wrong, text)
        assert base and set(base) == {NO_ANSWER}, base  # the untrained base answers with bytes
        assert "demo-node\tup\tCPU (" in text, text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, "".join(said)[-3000:]
        host, port = url.removeprefix("nats://").rsplit(":", 1)
        with pytest.raises(OSError):  # its nats-server went with it
            await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reading


async def _read(proc, said: list[str]) -> None:
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        said.append(line.decode(errors="replace"))


async def _until(said: list[str], text: str, proc, timeout: float) -> None:
    """Until the demo printed `text`; its exit meanwhile or the deadline fails the test with what it printed."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(text in line for line in said):
        if proc.returncode is not None or asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the demo never printed {text!r} (exit {proc.returncode}): {''.join(said)[-3000:]}")
        await asyncio.sleep(0.2)
