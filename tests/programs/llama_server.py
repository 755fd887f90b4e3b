"""An operator's restart command for a llama.cpp server (llama-cpp-python's OpenAI-compatible server), as a test
uses it: end the server this pid file names, start it again with the base GGUF and, when the agent gives one,
the adapter placed last ($JETLORA_ADAPTER_PATH; llama-server itself would take each of $JETLORA_ADAPTERS with
--lora, this server takes one), and return once it answers.

    python llama_server.py BASE.gguf PORT PIDFILE
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

base, port, pid_file = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if pid_file.is_file():  # end the running server, and wait until it has gone (its port is then free)
    old = int(pid_file.read_text())
    try:
        os.kill(old, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            os.kill(old, 0)
            time.sleep(0.05)
        os.kill(old, signal.SIGKILL)
    except ProcessLookupError:
        pass
cmd = [
    sys.executable,
    "-m",
    "llama_cpp.server",
    "--model",
    base,
    "--port",
    port,
    "--host",
    "127.0.0.1",
    "--n_ctx",
    "256",
    "--verbose",
    "false",
]
adapter = os.environ.get("JETLORA_ADAPTER_PATH") or os.environ.get("JETLORA_ADAPTERS", "").split(" ")[-1]
if adapter:
    cmd += ["--lora_path", adapter]
server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{pid_file}.log", "ab"), start_new_session=True)
pid_file.write_text(str(server.pid))
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if server.poll() is not None:
        sys.exit(f"llama_cpp.server exited {server.returncode}; see {pid_file}.log")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
            json.load(r)
            sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit("llama_cpp.server did not answer within 60 s")
