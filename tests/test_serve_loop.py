"""The server's event loop: uvloop where it is installed (a dependency on Linux), asyncio's own
loop where it is not."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pagoda.server.serve import run_event_loop


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_server_runs_on_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")
    assert run_event_loop(loop_module()).startswith("uvloop")


def test_without_uvloop_the_server_runs_on_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # NOTE: makes `import uvloop` raise ImportError
    assert run_event_loop(loop_module()).startswith("asyncio")
