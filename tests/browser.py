"""Headless Chromium (Debian's), driven over the DevTools protocol: what the tests of the built book
share (tests/test_book.py loads every page from file://, tests/test_page.py runs the reader's own
prompt in the page, served from a loopback server)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time

WIDTH, HEIGHT = 1280, 800
LOCAL = ("file:", "data:", "blob:", "about:")  # every other scheme is the network


class Browser:
    """Headless Chromium, spoken to over --remote-debugging-pipe (the DevTools protocol: JSON
    messages ended by a NUL byte, read from its fd 4 and written to its fd 3)."""

    def __init__(self):
        exe = shutil.which("chromium")
        assert exe, "Chromium is not installed: run `make browser` (Debian's chromium package)"
        # Chromium's own children may still write to the profile as it is removed
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-quic", "--remote-debugging-pipe", f"--window-size={WIDTH},{HEIGHT}",
             f"--user-data-dir={self.profile.name}", "about:blank"],
            close_fds=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=lambda: _as_fds_3_4(to_chrome, from_chrome))
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH,
                  height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            wait = deadline - time.time()
            assert wait > 0 and select.select([self._in], [], [], wait)[0], \
                "Chromium did not answer in time"
            chunk = os.read(self._in, 1 << 20)
            assert chunk, "Chromium closed the DevTools pipe"
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        m = json.loads(msg)
        if m.get("method") == "Target.attachedToTarget":  # the page, or a worker it started
            self._watch(m["params"]["sessionId"])
        return m

    def _watch(self, session: str) -> None:
        """A target's requests are seen (`requests`), and so are those of every worker it starts:
        a new worker waits at its start until its network events are on."""
        self._send("Network.enable", session)
        self._send("Target.setAutoAttach", session, autoAttach=True,
                   waitForDebuggerOnStart=True, flatten=True)
        self._send("Runtime.runIfWaitingForDebugger", session)

    def _send(self, method: str, session: str, **params) -> None:
        """A command whose answer nobody waits for (it lands in `events`)."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, "sessionId": session}
        os.write(self._out, json.dumps(msg).encode() + b"\0")

    def call(self, method: str, session: bool = False, _fail: bool = True,
             _timeout: float = 60, **params):
        self._id += 1
        mine = self._id  # a worker's arrival sends commands of its own meanwhile (`_watch`)
        msg = {"id": mine, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + _timeout
        while True:
            m = self._message(deadline)
            if m.get("id") == mine:
                if "error" in m and not _fail:
                    return None
                assert "error" not in m, f"{method}: {m['error']}"
                return m["result"]
            self.events.append(m)

    def goto(self, url: str) -> list[str]:
        """Load a page and let it settle; returns the URL of every request it made."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        for _ in range(3):  # a page that redirects (index.html) loads twice
            self._wait_for("Page.loadEventFired")
            settle = self.call("Runtime.evaluate", session=True, awaitPromise=True,
                               expression="new Promise(r => setTimeout(r, 200))", _fail=False)
            if settle is not None:  # nothing navigated away while what starts on load ran
                return self.requests()
        raise AssertionError(f"{url} kept navigating")

    def _wait_for(self, method: str) -> None:
        deadline = time.time() + 60
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == method:
                    self.events[i] = {"seen": method}
                    return
            self.events.append(self._message(deadline))

    def wait_until(self, expression: str, timeout: float = 30) -> None:
        """Until a condition holds on the page, through any navigation on the way."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = self.call("Runtime.evaluate", session=True, expression=expression,
                          returnByValue=True, _fail=False)
            if r and r["result"].get("value") is True:
                return
            time.sleep(0.1)
        raise AssertionError(f"still not true after {timeout} s: {expression}")

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"] + \
               [e["params"]["url"] for e in self.events
                if e.get("method") == "Network.webSocketCreated"]

    def js(self, expression: str, timeout: float = 60):
        r = self.call("Runtime.evaluate", session=True, expression=expression,
                      returnByValue=True, awaitPromise=True, _timeout=timeout)
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def mouse(self, kind: str, x: float, y: float) -> None:
        self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y,
                  button="left" if kind != "mouseMoved" else "none", clickCount=1)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.profile.cleanup()


def _as_fds_3_4(read_end: int, write_end: int) -> None:
    """In Chromium's process, before exec: the pipe's ends where it looks for them."""
    import fcntl

    r, w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (read_end, write_end))
    os.dup2(r, 3)
    os.dup2(w, 4)


def network(urls: list[str]) -> list[str]:
    return [u for u in urls if not u.startswith(LOCAL)]
