"""Start and stop a real `shuili serve` process on a free loopback port (tests and benchmarks).
(A uniquely named module, since the tests import it by name under --import-mode=importlib.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# SmolLM2 on a busy 2-core host: loading and the first step can take a while
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
BASE_ARGS = ("--threads", "1", "--max-model-len", "512")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    return e


class ServerProcess:
    def __init__(self, *args: str, log_path: str | os.PathLike):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "shuili", "serve", "--host", HOST, "--port", str(self.port),
               *BASE_ARGS, *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shuili serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"shuili serve was not ready within {START_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def start(*args: str, log_path) -> ServerProcess:
    srv = ServerProcess(*args, log_path=log_path)
    srv.wait_ready()
    return srv
