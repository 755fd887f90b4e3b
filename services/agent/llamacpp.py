"""llama.cpp's server: it opens adapter files only at start, and applies every one it was started with to every
request. So one engine serves one adapter name: the GGUF is placed as DIR/NAME.gguf and the operator's restart
command starts llama-server with it; a second name for the same engine is refused (run a second llama-server for
it), and a retired name is removed and the server restarted without it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from pathlib import Path

from schemas.registry import NodeState
from services.agent.engine_http import EngineHttp
from services.agent.engines import Engine, EngineError, get_json
from services.agent.engine_files import place, placed, remove

RESTART_TIMEOUT_S = 120.0  # an engine restart command (llama-server loading a model) is waited for this long


def placed_names(engine: Engine) -> list[str]:
    """The adapter names placed for the engine: what its restart starts it with."""
    if engine.directory is None or not engine.directory.is_dir():
        return []
    return sorted(p.stem for p in engine.directory.glob("*.gguf"))


def refusal(engine: Engine, name: str) -> str | None:
    """Why `name` cannot go on this engine: it serves another name already (llama-server would apply both)."""
    others = [n for n in placed_names(engine) if n != name]
    if others:
        return (
            f"this llama-server serves {others[0]} already, and llama-server applies every adapter it was started "
            f"with to every request; retire {others[0]} first, or serve {name} from another llama-server "
            "(another --engine)"
        )
    return None


async def load(engine: Engine, name: str, local: Path, *, http: EngineHttp) -> tuple[NodeState, str]:
    """Place the GGUF and restart llama-server with it (`http`: the driver's common signature; unused here)."""
    if why := await asyncio.to_thread(refusal, engine, name):  # it lists the directory: not on the loop
        raise EngineError(f"refused: {why}")
    target = placed(engine, name)
    await asyncio.to_thread(place, local, target)
    if not engine.restart:
        return "needs-restart", (
            f"placed {target}; llama-server opens adapters only at start: restart it with "
            f"--lora {target} (or give the agent --engine-restart)"
        )
    await restart(engine, {"JETLORA_ADAPTER": name, "JETLORA_ADAPTER_PATH": str(target)})
    return "loaded", f"placed {target} and restarted llama-server"


async def unload(engine: Engine, name: str, *, http: EngineHttp) -> tuple[NodeState, str]:
    target = placed(engine, name)
    await asyncio.to_thread(remove, target)
    if not engine.restart:
        return "needs-restart", (
            f"removed {target}; llama-server serves it until restarted without it: restart it "
            "(or give the agent --engine-restart)"
        )
    await restart(engine)
    return "unloaded", f"removed {target} and restarted llama-server without it"


async def served(engine: Engine, *, http: EngineHttp) -> dict[str, str] | None:
    """The adapters llama-server was started with (GET /lora-adapters), name -> path; None when it does not answer
    or cannot say (llama-cpp-python's server has no such endpoint)."""
    code, body = await get_json(f"{engine.url}/lora-adapters", http=http)
    if code != 200 or not isinstance(body, list):
        return None
    return {Path(str(a.get("path", ""))).stem: str(a.get("path", "")) for a in body if isinstance(a, dict)}


async def restart(engine: Engine, env: dict[str, str] | None = None, timeout: float = RESTART_TIMEOUT_S) -> None:
    """Run the operator's restart command: $JETLORA_ADAPTERS lists the adapter placed for the engine (none after a
    retire), $JETLORA_ADAPTER(_PATH) the one just placed. The command's own exit is waited for, at most `timeout` s
    (a server it starts in the background may keep running); its stderr goes to a file, so a child that inherits
    it cannot hold the wait open."""
    files = " ".join(str(placed(engine, n)) for n in await asyncio.to_thread(placed_names, engine))
    with tempfile.TemporaryFile() as err:
        proc = await asyncio.create_subprocess_shell(
            engine.restart,
            env={**os.environ, "JETLORA_ADAPTERS": files, **(env or {})},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise EngineError(
                f"the restart command did not exit within {timeout:.0f}s and was killed; a command that "
                "starts a server must start it in the background (e.g. `nohup llama-server ... &`)"
            ) from None
        if code:
            err.seek(0)
            raise EngineError(f"the restart command exited {code}: {err.read().decode(errors='replace')[-300:]}")
