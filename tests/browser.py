"""Drive real headless Chromium over the DevTools protocol (a websocket, through aiohttp):
load a page, run a line of JavaScript in it, move the mouse, take a screenshot at a set
window size -- what a person does with the node picture, without a reload in between."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

T = TypeVar("T")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--remote-debugging-port=0", "--remote-allow-origins=*"]


class Browser:
    """One Chromium, one tab.  Use as ``async with Browser(profile, 1366, 900) as b``."""

    def __init__(self, profile: Path, width: int = 1366, height: int = 900) -> None:
        self.profile, self.width, self.height = profile, width, height
        self._next = 0

    async def __aenter__(self) -> Browser:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            pytest.fail("chromium not found: install the Debian package 'chromium' (scripts/test does)")
        self.profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={self.width},{self.height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                pytest.fail("chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            page = next(t for t in await resp.json(content_type=None) if t["type"] == "page")
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Emulation.setDeviceMetricsOverride",
                        width=self.width, height=self.height, deviceScaleFactor=1, mobile=False)
        await self.send("Page.enable")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()
        await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    async def send(self, method: str, **params: Any) -> dict:
        self._next += 1
        ident = self._next
        await self.ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), 60)).data)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && !!document.querySelector('svg')")

    async def eval(self, expression: str) -> Any:
        got = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise AssertionError(f"{expression[:80]}: {got['exceptionDetails']}")
        return got["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not await self.eval(f"!!({expression})"):
            if time.monotonic() > deadline:
                raise AssertionError(f"never true in the page: {expression}")
            await asyncio.sleep(0.1)

    async def hover(self, x: float, y: float) -> None:
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    async def screenshot(self, path: Path, full_page: bool = False) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        png = base64.b64decode((await self.send("Page.captureScreenshot", **params))["data"])
        path.write_bytes(png)
        return png


class SharedBrowser:
    """One Chromium window for a test module's pages, driven from one event loop of its own
    (``run``): a launch costs about a second, and each page is loaded afresh by navigation."""

    def __init__(self, profile: Path, width: int = 1366, height: int = 900) -> None:
        self.loop = asyncio.new_event_loop()
        self.browser = Browser(profile, width, height)
        try:
            self.run(self.browser.__aenter__())
        except BaseException:
            self.loop.close()
            raise

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def close(self) -> None:
        try:
            self.run(self.browser.__aexit__(None, None, None))
        finally:
            self.loop.close()
