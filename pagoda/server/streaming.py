"""Async plumbing for the routes: merging engine streams, watching for a client that
leaves, and framing chunks as server-sent events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from pagoda.server.chunks import event_json
from pagoda.server.errors import APIError, error_event, sse_error

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


async def _until_error(items: AsyncIterator[T]) -> AsyncIterator[T | APIError]:
    """`items`, then the error that ended them if one did (anything unexpected as a 500)."""
    try:
        async for item in items:
            yield item
    except APIError as e:
        yield e
    except Exception as e:
        logger.exception("stream failed")
        yield APIError(500, f"{type(e).__name__}: {e}")


async def sse(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk (its JSON), an error event on failure,
    [DONE]."""
    async for chunk in _until_error(chunks):
        yield sse_error(chunk) if isinstance(chunk, APIError) else f"data: {chunk}\n\n"
    yield "data: [DONE]\n\n"


async def sse_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Named server-sent events (the Responses API's): `event: <type>` then the event's JSON,
    numbered by `sequence_number`; a failure ends the stream with an `error` event (which,
    like the chat stream's, carries an `error` object). No [DONE], as OpenAI's."""
    number = 0
    async for item in _until_error(events):
        event = error_event(item) if isinstance(item, APIError) else item
        event["sequence_number"] = number
        number += 1
        yield f"event: {event['type']}\ndata: {event_json(event)}\n\n"
