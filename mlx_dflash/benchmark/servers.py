"""Servers side by side for the serving benchmarks (scripts/serve_load.py, scripts/agent_session.py):
`dflash-mlx serve` and `mlx_lm.server` on the same model, each a subprocess on a free port.

mlx-lm's server is started through this package's BLAS loader (mlx_dflash/_blas.py), so both
use the same OpenBLAS on Linux and a comparison measures the servers, not the BLAS.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MLX_LM_SERVER = (
    "import sys; import mlx_dflash._blas as b; b.load_openblas(); "
    "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
)


@dataclass
class Server:
    kind: str  # "mlx-lm", or a name for one of ours
    url: str  # http://127.0.0.1:PORT
    model: str  # the id it serves (what requests name)
    proc: subprocess.Popen
    start_line: str = ""  # ours: the line `serve` printed when it was ready (mode, budget)
    log: list[str] = field(default_factory=list)  # its last lines on stderr

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, args: list[str] = (), timeout: float = 600) -> Server:
    """Start `kind` ("mlx-lm", or any other name for `dflash-mlx serve ARGS`) on `model`, and
    wait until it answers."""
    port = free_port()
    if kind == "mlx-lm":
        cmd = [sys.executable, "-c", MLX_LM_SERVER, "--model", model, "--port", str(port)]
    else:
        dflash = str(Path(sys.executable).parent / "dflash-mlx")
        cmd = [dflash, "serve", "-m", model, "--port", str(port)]
    cmd += list(args)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} server exited: {proc.stderr.read()[-2000:]}")
        try:
            if kind == "mlx-lm":  # (its /v1/models lists the hub cache; it serves --model)
                urllib.request.urlopen(url + "/health", timeout=2).read()
                return _drained(Server(kind, url, model, proc))
            models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=2).read())
            served = Server(kind, url, models["data"][0]["id"], proc, _start_line(proc))
            return _drained(served)
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{kind} server did not start in {timeout:.0f} s")


def _start_line(proc: subprocess.Popen) -> str:
    """Our server's 'Serving ...' line (it is printed before the server answers), with any
    note printed before it."""
    lines = []
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline()
        if not line:
            return " ".join(lines)
        lines.append(line.strip())
        if line.startswith("Serving "):
            return " ".join(lines)


def _drained(server: Server) -> Server:
    """Read the server's stderr from now on in a thread (a request log left in a full pipe
    would block the server), keeping its last lines."""
    tail: list[str] = []
    server.log = tail

    def drain():
        assert server.proc.stderr is not None
        for line in server.proc.stderr:
            tail.append(line)
            del tail[:-50]

    threading.Thread(target=drain, daemon=True).start()
    return server


def stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@contextmanager
def running(kind: str, model: str, args: list[str] = ()):
    server = start(kind, model, args)
    try:
        yield server
    finally:
        stop(server)
