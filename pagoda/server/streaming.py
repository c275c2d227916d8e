"""Async plumbing for the routes: merging engine streams, watching for a client that
leaves, and framing chunks as server-sent events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from pagoda.server.errors import APIError, sse_error

logger = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yields (stream index, item) from several async iterators as items arrive."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    # NOTE: each stream ends with an exception or _END in the queue.
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _END:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Awaits `work`, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    logger.info("client disconnected; request aborted")
    return None


async def sse(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk (its JSON), an error event on failure,
    [DONE]."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
    except APIError as e:
        yield sse_error(e)
    except Exception as e:
        logger.exception("stream failed")
        yield sse_error(APIError(500, f"{type(e).__name__}: {e}"))
    yield "data: [DONE]\n\n"
