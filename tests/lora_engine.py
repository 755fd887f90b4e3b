"""A small real HTTP server speaking what the agent asks of vLLM about adapters, for tests that cannot run vLLM:
its runtime LoRA API (/v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter), completions under an adapter's
name (with the log-probabilities parity asks for: `logprob_token_ids`, one value per name that a test sets), chat
completions under a name (answered by what a test sets for it: a served eval's answers), the filesystem resolver (a
name it does not know, placed in its directory with the base model's path, is loaded at its first request) and
`/metrics` with `vllm:lora_requests_info`, a series per label set as vLLM keeps them, valued at the time of the step
that set it. It answers in vLLM's shapes and errors, nothing more."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

BASE, ROOT = "tiny", "/models/tiny"  # the served model's name and its `--model` (what /v1/models calls its root)


class LoraEngine:
    def __init__(self, resolver_dir: Path | None = None) -> None:
        self.resolver_dir = resolver_dir
        self.adapters: dict[str, str] = {}  # name -> the path it was loaded from
        self.unloads: list[str] = []  # every name unloaded through the API, in order
        self.running: set[str] = set()  # adapters with a request running now (a test sets it), beside each completion
        self.series: dict[tuple[str, str], float] = {}  # (running, waiting) label values -> when last set
        self.answers: dict[str, Callable[[list[dict]], str]] = {}  # name -> its chat answer to the messages
        self.logprobs: dict[str, float] = {}  # name -> the log-probability it gives every token asked (else -1)
        self.chats: list[dict] = []  # every chat completion request, as sent
        self.url = ""

    async def start(self) -> "LoraEngine":
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    def step(self, running: set[str]) -> None:
        """An engine step with these adapters' requests running (and those in `self.running`), as its metrics then
        show them."""
        self.series[(",".join(sorted(running | self.running)), "")] = time.time()

    async def _models(self, _request: web.Request) -> web.Response:
        data = [{"id": BASE, "object": "model", "root": ROOT, "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in self.adapters.items()]
        return web.json_response({"object": "list", "data": data})

    async def _load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if name in self.adapters and not body.get("load_inplace"):
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        if not (Path(path) / "adapter_config.json").is_file():
            return _error(400, f"No adapter found for {path}")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        self.unloads.append(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["model"]
        if name != BASE and name not in self.adapters and not self._resolve(name):
            return _error(404, f"The model `{name}` does not exist.")
        if name != BASE:
            self.step({name})
        if "logprob_token_ids" in body:  # parity: each prefix, the log-probability of every token asked about
            value = self.logprobs.get(name, -1.0)
            top = {f"token_id:{t}": value for t in body["logprob_token_ids"]}
            choices = [
                {"index": i, "text": "", "logprobs": {"top_logprobs": [top]}} for i in range(len(body["prompt"]))
            ]
            return web.json_response({"object": "text_completion", "choices": choices})
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": f" {name} here"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["model"]
        if name != BASE and name not in self.adapters and not self._resolve(name):
            return _error(404, f"The model `{name}` does not exist.")
        self.chats.append(body)
        text = self.answers[name](body["messages"]) if name in self.answers else f" {name} here"
        message = {"role": "assistant", "content": text}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}]})

    def _resolve(self, name: str) -> bool:
        """vLLM's filesystem resolver: a directory of that name whose base model is this engine's `--model`."""
        config = self.resolver_dir / name / "adapter_config.json" if self.resolver_dir else None
        if (
            config is None
            or not config.is_file()
            or json.loads(config.read_text()).get("base_model_name_or_path") != ROOT
        ):
            return False
        self.adapters[name] = str(config.parent)
        return True

    async def _metrics(self, _request: web.Request) -> web.Response:
        lines = ["vllm:num_requests_running 0.0", "vllm:num_requests_waiting 0.0"]
        lines += [
            f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{r}",waiting_lora_adapters="{w}"}} {at}'
            for (r, w), at in self.series.items()
        ]
        return web.Response(text="\n".join(lines) + "\n")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)
