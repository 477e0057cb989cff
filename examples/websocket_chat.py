"""A websocket chat room that says goodbye and closes with 1001 when draining (Starlette).

    graceful run examples.websocket_chat:app --port 8000

Every text message sent to ``/chat`` goes to every member of the room.  When the server
starts draining, each member gets ``server restarting, reconnect`` and a close frame with
code 1001 (going away) — from the app, at once, rather than from the middleware after
``websocket_close_grace_s`` — so clients reconnect to another backend.
"""

from __future__ import annotations

import contextlib

import anyio
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

import graceful.asgi

room: set[WebSocket] = set()


async def broadcast(text: str) -> None:
    for member in list(room):
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # it left meanwhile
            await member.send_text(text)


# --8<-- [start:chat]
async def chat(websocket: WebSocket) -> None:
    await websocket.accept()
    signal = graceful.asgi.drain_signal(websocket.scope)
    room.add(websocket)
    print(f"member joined ({len(room)} in the room)", flush=True)
    try:
        async with anyio.create_task_group() as tasks:

            async def goodbye_when_draining() -> None:
                if signal is None:
                    return
                await signal.wait()
                room.discard(websocket)
                await websocket.send_text("server restarting, reconnect")
                await websocket.close(code=1001, reason="server restarting")
                tasks.cancel_scope.cancel()

            tasks.start_soon(goodbye_when_draining)
            async for text in websocket.iter_text():  # ends when the client leaves
                await broadcast(text)
            tasks.cancel_scope.cancel()
    finally:
        room.discard(websocket)
    # --8<-- [end:chat]


app = Starlette(routes=[WebSocketRoute("/chat", chat)])
