"""Headless Chromium driven over the DevTools protocol: log in with a JWT cookie, use or screenshot a page.

The registry page sits behind Airflow's authentication, so the browser gets the same
`_token` cookie the Airflow UI sets after login, then loads the page and captures a PNG, or
(`browser`) fills and submits its forms as a person does and watches what the page then does by itself.
Also a tiny PNG decoder (zlib + filters) to check that the screenshot is not blank, and
`section` to read one titled part of a registry page's HTML.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage", "--no-first-run", "--window-size=1280,900"]


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def screenshot(url: str, token: str, port: int, binary: str, timeout: float = 60) -> tuple[bytes, str]:
    """Open `url` with the `_token` cookie set; return a PNG of the viewport and the page's title."""
    with browser(url, token, port, binary, timeout) as page:
        page.open(url)
        return page.screenshot(), page.eval("document.title")


@contextlib.contextmanager
def browser(url: str, token: str, port: int, binary: str, timeout: float = 60) -> Iterator[Page]:
    """A headless Chromium holding the `_token` cookie for `url`'s host, and its one tab."""
    from websockets.sync.client import connect

    # Chromium's helper processes may still write the profile while it is removed: ignore that.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--remote-debugging-port={port}",
                                 f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            ws_url = _page_ws(port, timeout)
            with connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=timeout) as ws:
                cdp = _Cdp(ws, timeout)
                cdp.call("Network.enable")
                cdp.call("Page.enable")
                cdp.call("Network.setCookie", name="_token", value=token, domain=urlsplit(url).hostname, path="/")
                yield Page(cdp)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the browser and its helpers (one session)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


class Page:
    """The browser's tab: open a URL, run JavaScript in it, wait for what it shows, count its page loads."""

    def __init__(self, cdp: _Cdp) -> None:
        self.cdp = cdp

    @property
    def loads(self) -> int:
        """Documents loaded in this tab so far (a reload, a form's answer or a redirect each counts)."""
        return self.cdp.events.count("Page.loadEventFired")

    def open(self, url: str) -> None:
        seen = self.loads
        self.cdp.call("Page.navigate", url=url)
        self.cdp.wait_event("Page.loadEventFired", after=seen)

    def eval(self, expression: str):
        """The value of a JavaScript expression in the current document."""
        return self.cdp.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> None:
        """Poll until the expression is true in whatever document the tab shows (it may load new ones)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.eval(expression):
                    return
            except RuntimeError:  # the document went away mid-call (a navigation): ask the next one
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true in {timeout}s: {expression}; the page says: "
                                   f"{self.eval('document.body && document.body.innerText')}")
            self.cdp.drain(0.5)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.cdp.call("Page.captureScreenshot", format="png")["data"])


def _page_ws(port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
            pages = [t for t in targets if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError("chromium DevTools endpoint did not come up")


class _Cdp:
    def __init__(self, ws, timeout: float) -> None:
        self.ws, self.timeout, self.next_id, self.events = ws, timeout, 0, []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=self.timeout))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg.get("method"))

    def wait_event(self, method: str, after: int = 0) -> None:
        """Until more than `after` events named `method` have come."""
        deadline = time.monotonic() + self.timeout
        while self.events.count(method) <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {method} event")
            self.events.append(json.loads(self.ws.recv(timeout=remaining)).get("method"))

    def drain(self, seconds: float) -> None:
        """Record the events that come within `seconds` (the tab's own loads, while we wait on it)."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(TimeoutError):
            while (remaining := deadline - time.monotonic()) > 0:
                self.events.append(json.loads(self.ws.recv(timeout=remaining)).get("method"))


def decode_png(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, unfiltered rows) of an 8-bit RGB/RGBA/gray PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8, f"bit depth {depth} not supported"
            bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytes(width * bpp)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = bytes(line)
    return width, height, bpp, rows


def pixel_stats(png: bytes) -> tuple[int, float]:
    """(number of distinct colours, variance of the luminance-ish byte values) over the image."""
    _w, _h, bpp, rows = decode_png(png)
    colours: set[bytes] = set()
    total = total_sq = n = 0
    for row in rows[::4]:
        for x in range(0, len(row), bpp * 4):
            px = row[x:x + min(bpp, 3)]
            colours.add(px)
            v = sum(px) / len(px)
            total += v
            total_sq += v * v
            n += 1
    mean = total / n
    return len(colours), total_sq / n - mean * mean


def section(page_html: str, ident: str) -> str:
    """The inside of a registry page's `<section id='ident'>` (its parts: aliases, versions, overlay, ...)."""
    match = re.search(rf"<section id='{ident}'>(.*?)</section>", page_html, re.S)
    assert match, f"no section {ident!r} in the page"
    return match.group(1)
