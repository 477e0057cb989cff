"""Ctrl-C in a terminal: the dev loop.  A SIGINT that the terminal sends to its
foreground process group drains at once, as stock servers do — no balancer routes to a
terminal, so waiting for an idle window only makes the developer wait — and no
"no kill deadline known" warning is printed there.  Real ``graceful run`` processes on
a real pseudo-terminal: the test types ``^C`` into it and the kernel's line discipline
sends the SIGINT, exactly as for a person at a keyboard."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import subprocess
import sys
import termios
import threading
import time

import pytest

from tests.support.servers import ROOT, RawHTTP

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux ptys")

#: The colours uvicorn's log lines have on a terminal.
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Apps with ``/slow?s=N`` that print "slow request started".
ASGI_APP = "examples.asgi_app:app"
AIOHTTP_APP = "tests.support.aiohttp_apps.app:app"


class TerminalProcess:
    """A process whose controlling terminal is a pty this test types into."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRACEFUL_")}
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave,
            env={**env, "PYTHONUNBUFFERED": "1"}, preexec_fn=_take_terminal,
        )  # fmt: skip
        os.close(slave)
        self.text = ""
        self.raw = ""  # with the colours
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal is gone
                data = b""
            with self._cond:
                if not data:
                    self.text += "\0"  # end of output
                    self._cond.notify_all()
                    return
                self.raw += data.decode(errors="replace")
                self.text += ANSI.sub("", data.decode(errors="replace"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(re.findall(pattern, self.text)) < count:
                left = deadline - time.monotonic()
                assert left > 0, (pattern, self.text)
                assert "\0" not in self.text, (pattern, self.text)
                self._cond.wait(left)

    def wait_exit(self, timeout_s: float = 15.0) -> int:
        """The exit status, once the output up to the end was read."""
        status = self.proc.wait(timeout_s)
        self._reader.join(5.0)
        return status

    def type_ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(10)
        os.close(self.master)


def _take_terminal() -> None:
    os.setsid()  # a new session, whose controlling terminal becomes the pty
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.parametrize(
    ("options", "stopped"),
    [([], 1), (["--server", "hypercorn"], 1), (["--server", "aiohttp"], 1),
     (["--workers", "2"], 2)],
    ids=["uvicorn", "hypercorn", "aiohttp", "workers"],
)  # fmt: skip
def test_ctrl_c_drains_at_once_and_finishes_the_request(options: list[str], stopped: int) -> None:
    # The default policy, accept-until-idle with a 2 s idle window, and no grace period.
    app = AIOHTTP_APP if "aiohttp" in options else ASGI_APP
    term = TerminalProcess([sys.executable, "-m", "graceful", "run", app, "--port", "0", *options])
    try:
        if "--workers" in options:
            term.wait_for(r"worker \d+ serves", count=2)
        term.wait_for(r"[Rr]unning on http://127\.0\.0\.1:\d+|listening on http")
        port = int(re.findall(r"http://127\.0\.0\.1:(\d+)", term.text)[0])
        client = RawHTTP(port)
        client.send("/slow?s=1")
        term.wait_for(r"slow request started")
        term.type_ctrl_c()
        term.wait_for(r"-> draining: SIGINT \(terminal\) \(no accepting period\)", count=stopped)
        assert client.response()[0] == 200
        assert term.wait_exit() == 0
    finally:
        RawHTTP.close_all()
        term.close()
    assert "no new connection for" not in term.text  # no idle window
    assert "no kill deadline known" not in term.text
    assert "kill deadline: none known (30 s assumed); Ctrl-C drains at once" in term.text
    if not options:  # uvicorn's colours on a terminal, ours too
        assert "\x1b[32mINFO\x1b[0m:     policy accept-until-idle" in term.raw, term.raw
