"""Shim for vLLM's tests/utils.py: RemoteOpenAIServer launches a *pagoda* server.

`pagoda serve smollm2 --served-model-name <the test's MODEL_NAME> <the test's vLLM args>`
from the pagoda checkout (PAGODA_DIR), waits for /health, and hands out url_for/get_client/
get_async_client like vLLM's RemoteOpenAIServer. Server logs go to PAGODA_TEST_LOGS.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import time

import openai
import requests

PAGODA_DIR = os.environ["PAGODA_DIR"]  # NOTE: set by run.sh
PAGODA_PY = os.path.join(PAGODA_DIR, ".venv/bin/python")
PAGODA_MODEL = os.environ.get("PAGODA_MODEL", "smollm2")
LOG_DIR = os.environ["PAGODA_TEST_LOGS"]  # NOTE: set by run.sh
SMOLLM2_MAX_POS = 8192

_live: set[RemoteOpenAIServer] = set()


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all():
    for srv in list(_live):
        srv._shutdown()


atexit.register(_kill_all)


def _on_term(signum, frame):  # `timeout` sends SIGTERM: take the servers down too
    _kill_all()
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _on_term)


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None, seed: int | None = 0,
                 auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:
        args = list(vllm_serve_args)
        # a "--model=X" / "--model X" among the args picks the served name
        served = model
        out: list[str] = []
        i = 0
        while i < len(args):
            a = args[i]
            if a.startswith("--model="):
                served = a.split("=", 1)[1]
            elif a == "--model":
                served = args[i + 1]
                i += 1
            else:
                out.append(a)
            i += 1
        args = out
        if auto_port:
            if "-p" in args or "--port" in args:
                raise ValueError("port given with auto_port=True")
            args += ["--port", str(get_open_port())]
        if seed is not None:
            if "--seed" in args:
                raise ValueError("seed given twice")
            args += ["--seed", str(seed)]
        # SmolLM2 has 8192 positions; a test asking for more (Qwen3 has 40960) gets them by override
        mml = None
        for j, a in enumerate(args):
            if a == "--max-model-len":
                mml = args[j + 1]
            elif a.startswith("--max-model-len="):
                mml = a.split("=", 1)[1]
        hf_over = dict(override_hf_configs or {})
        if mml is not None and mml.isdigit() and int(mml) > SMOLLM2_MAX_POS:
            hf_over.setdefault("max_position_embeddings", int(mml))
        if hf_over:
            args += ["--hf-overrides", json.dumps(hf_over)]
        if "--served-model-name" not in args:
            args += ["--served-model-name", served]
        self.host = "127.0.0.1"
        self.port = int(args[args.index("--port") + 1])
        self.uds = None
        env = os.environ.copy()
        for k in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(k, None)
        if env_dict:
            env.update(env_dict)
        cmd = [PAGODA_PY, "-m", "pagoda.cli", "serve", PAGODA_MODEL, *args]
        os.makedirs(LOG_DIR, exist_ok=True)
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", served)
        self.log_path = os.path.join(LOG_DIR, f"server-{tag}-{self.port}.log")
        self._log = open(self.log_path, "w")
        self._log.write("CMD: " + " ".join(cmd) + "\n")
        self._log.flush()
        print(f"[shim] launching pagoda: {' '.join(cmd)} (log {self.log_path})")
        self.proc = subprocess.Popen(cmd, cwd=PAGODA_DIR, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _live.add(self)
        try:
            self._wait_for_server(url=self.url_for("health"), timeout=max_wait_seconds or 240)
        except Exception:
            self._shutdown()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._shutdown()

    def _shutdown(self) -> None:
        if self not in _live:
            return
        _live.discard(self)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._log.close()

    def _wait_for_server(self, *, url: str, timeout: float):
        start = time.time()
        while True:
            try:
                if requests.get(url, timeout=5).status_code == 200:
                    return
            except Exception:
                pass
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"Server exited unexpectedly (rc={rc}); see {self.log_path}")
            if time.time() - start > timeout:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.5)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def get_async_client_anthropic(self, **kwargs):
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0,
                                        **kwargs)


# names other vLLM tests import from tests.utils
ROCM_EXTRA_ARGS: list[str] = []
ROCM_ENGINE_KWARGS: dict = {}


class RemoteLaunchRenderServer(RemoteOpenAIServer):
    """vLLM's `vllm launch render` (a server of the render routes alone): `pagoda serve` with
    `--enable-scale-out`, which serves them beside the rest."""

    def __init__(self, model: str, vllm_serve_args: list[str], **kwargs) -> None:
        super().__init__(model, [*vllm_serve_args, "--enable-scale-out"], **kwargs)
