"""Where POSIX signals do not exist (Windows has no SIGQUIT, SIGHUP, SIGUSR1, …),
``import graceful`` and the ASGI middleware still work: checked in a subprocess that
removes those signals from the ``signal`` module before graceful is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import signal
    for name in ("SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD", "SIGKILL",
                 "SIGSTOP", "SIGCONT", "SIGPIPE", "SIGWINCH", "SIGTTIN", "SIGTTOU"):
        if hasattr(signal, name):
            delattr(signal, name)
    import anyio
    import graceful
    import graceful.asgi
    import graceful.uvicorn
    import graceful.hypercorn

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hi"})

    async def main():
        coordinator = graceful.ShutdownCoordinator()
        middleware = graceful.asgi.GracefulMiddleware(app, coordinator=coordinator)
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        for path in ("/", "/readyz"):
            scope = {"type": "http", "path": path, "method": "GET", "headers": [],
                     "client": ("127.0.0.1", 5000), "http_version": "1.1"}
            await middleware(scope, receive, send)
        print([m.get("status") for m in sent if m["type"] == "http.response.start"])

    anyio.run(main)
    """
)


def test_import_and_middleware_without_posix_signals() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[200, 200]"
