"""The built docs site in a real browser: the graph pictures are on the pages and have a size,
no page shows an example's test scaffolding, and examples show the output they printed.

Builds the site (its pictures are drawn at build time by ``docs/gen_images.py``, examples'
output by ``docs/gen_examples.py``), opens the pages in headless Chromium (Debian package ``chromium``, which
``scripts/test.sh`` installs) and asks the page, through the DevTools protocol over a pipe
(standard library only), for every image's loaded and laid-out size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed and could not be "
                                                         "(scripts/test.sh installs the Debian package chromium)")

IMAGES_JS = """
(async () => {
  const imgs = Array.from(document.querySelectorAll("article img"));
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = r; i.onerror = r; })));
  return imgs.map(i => { const b = i.getBoundingClientRect();
    return {src: i.getAttribute("src"), alt: i.alt, width: b.width, height: b.height,
            natural: [i.naturalWidth, i.naturalHeight]}; });
})()
"""


# The text a reader sees (rendered, visible), and the output blocks under examples.
TEXT_JS = """
(() => ({text: document.querySelector("article").innerText,
         outputs: Array.from(document.querySelectorAll("article .highlight"))
           .filter(b => (b.querySelector(".filename") || {}).textContent === "Output")
           .map(b => b.querySelector("code").innerText)}))()
"""


class Browser:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire() -> None:  # in the child: the pipe ends become fds 3 and 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--allow-file-access-from-files",
             f"--user-data-dir={profile}", "--window-size=1280,2000", "about:blank"],
            preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._buffer = b""

    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        return self._next

    def _receive(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        wanted = self._send(method, params, session)
        while True:
            msg = self._receive()
            if msg.get("id") == wanted:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def wait_event(self, method: str, session: str) -> None:
        while True:
            msg = self._receive()
            if msg.get("method") == method and msg.get("sessionId") == session:
                return

    def evaluate_on(self, url: str, expression: str) -> object:
        """Load ``url`` in a new tab and return the value of a JavaScript ``expression`` there."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session)
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=session)
        self.call("Target.closeTarget", {"targetId": target})
        return result["result"]["value"]

    def images_on(self, url: str) -> list[dict]:
        return self.evaluate_on(url, IMAGES_JS)

    def close(self) -> None:
        try:
            self._send("Browser.close")
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


@pytest.fixture(scope="module")
def site():
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-d", out], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"mkdocs build failed:\n{proc.stderr[-4000:]}"
        yield Path(out)


@pytest.fixture(scope="module")
def browser():
    with tempfile.TemporaryDirectory() as profile:
        b = Browser(profile)
        yield b
        b.close()


@pytest.mark.parametrize(("page", "picture"), [
    ("index.html", "images/first-trace-graph.svg"),
    ("drawing/index.html", "images/tinylm-depth2.svg"),
])
def test_graph_picture_is_shown_with_a_size(site, browser, page, picture):
    assert (site / picture).stat().st_size > 1000  # drawn at build time, not an empty file
    images = browser.images_on((site / page).as_uri())
    shown = [i for i in images if i["src"].endswith(picture)]
    assert shown, f"{picture} is not on {page}; images there: {[i['src'] for i in images]}"
    for image in shown:
        assert image["natural"][0] > 0 and image["natural"][1] > 0, f"{picture} did not load on {page}"
        assert image["width"] > 50 and image["height"] > 50, f"{picture} has no size on {page}: {image}"


def test_every_picture_on_the_drawing_page_loads(site, browser):
    images = browser.images_on((site / "drawing" / "index.html").as_uri())
    assert len(images) >= 9
    broken = [i["src"] for i in images if not (i["natural"][0] > 0 and i["width"] > 0)]
    assert not broken, f"pictures that did not load or have no size: {broken}"


def test_no_page_shows_test_scaffolding(site, browser):
    """Examples are tested through a ``# migration-test:`` line and a closing ``RESULT``; the reader
    sees neither, on any page."""
    pages = sorted(site.rglob("index.html"))
    assert len(pages) > 10
    for page in pages:
        shown = browser.evaluate_on(page.as_uri(), TEXT_JS)
        where = page.relative_to(site)
        assert "migration-test" not in shown["text"], f"{where} shows a test marker"
        assert "RESULT" not in shown["text"], f"{where} shows an example's RESULT"


def test_examples_show_what_they_printed(site, browser):
    shown = browser.evaluate_on((site / "coming-from-transformerlens" / "index.html").as_uri(), TEXT_JS)
    outputs = shown["outputs"]
    assert len(outputs) >= 3, outputs
    assert any("final_post" in out and "PatchingResult" in out for out in outputs), outputs
    assert any("reads agree: True" in out and "patches agree: False" in out for out in outputs), outputs
