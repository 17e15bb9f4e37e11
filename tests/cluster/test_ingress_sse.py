"""Unit test of the ingress's SSE response (no server): how it ends when Serve reports a disconnect."""

from __future__ import annotations

import asyncio


def test_sse_response_takes_a_cancelled_receive_as_a_disconnect():
    """What Serve's receive proxy does on a disconnect (raise ``TaskCancelledError`` from ``receive()``) ends
    the response normally and closes the body iterator (whose ``finally`` cancels the engine request)."""
    from ray.exceptions import TaskCancelledError

    from cluster.ingress import _SSEResponse

    closed = asyncio.Event()

    async def body():
        try:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def receive():
        await asyncio.sleep(0.05)
        raise TaskCancelledError()

    async def send(message):
        pass

    async def run() -> None:
        scope = {"type": "http", "asgi": {"spec_version": "2.1"}}
        await _SSEResponse(body())(scope, receive, send)  # raised TaskCancelledError before the fix
        assert closed.is_set()

    asyncio.run(run())
