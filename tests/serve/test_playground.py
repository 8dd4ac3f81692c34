"""The playground page at `/` (src/sparrow/serve/playground.html), driven in a real headless chromium.

A live uvicorn server on 127.0.0.1 (a tiny float32 model slowed like a big one, a draft-model drafter on a
perturbed copy, an API key) serves the page; chromium talks the DevTools protocol over a pipe
(`--remote-debugging-pipe`: no port, no websocket library). The test types the key and a message, presses Enter, waits
for the stream to end, and checks
the rendered text: the reply equals the server's non-streamed greedy reply, spans show both drafted and target
text, the stats line shows tokens/s and the acceptance; a second turn (sent with the Send button) carries the
whole history; a bad setting shows the server's error. It saves a screenshot (a valid PNG).

Skipped only when no chromium binary is found (Debian: `apt-get install -y chromium`).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import perturbed, tiny_model, tiny_tokenizer
from live import serving
from PIL import Image

from sparrow.drafters import build_drafter
from sparrow.models import LoadedModel
from sparrow.pipeline import Pipeline
from sparrow.serve import Scheduler, create_app

KEY = "sk-playground"
FIRST, SECOND = "The quick brown fox", "Paris is the capital of"
MAX_TOKENS = 24
WIDTH, HEIGHT = 1100, 900
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only cost time on a shared CPU


def chromium_binary() -> str | None:
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def server(one_thread):
    """uvicorn on a free loopback port, with an API key; yields the base URL once /health is 200."""
    target = LoadedModel(model=tiny_model("llama", seed=0), tokenizer=tiny_tokenizer(), name="tiny")
    draft = LoadedModel(model=perturbed(target.model, 0.1, seed=1), tokenizer=target.tokenizer, name="draft")
    # every target forward costs 10 ms more, as a big model's would (memory-bound: flat in the tokens scored), so
    # the scheduler's cost model finds drafting worth it whatever this CPU's timings (after the copy: the draft
    # stays fast)
    target.model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))
    pipe = Pipeline(target, build_drafter("draft-model", target, draft, 4))
    with serving(create_app(Scheduler(lambda: pipe), model_name="tiny", api_key=KEY)) as url:
        yield url


class Chromium:
    """Headless chromium and one page, over the DevTools protocol on a pipe (JSON messages ending in NUL;
    chromium reads fd 3 and writes fd 4)."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser, self._out = os.pipe()
        self._in, from_browser = os.pipe()
        # fds >= 10 in the child, so moving them to 3 and 4 never overwrites one with the other
        child_in, child_out = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser))
        os.close(to_browser), os.close(from_browser)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--mute-audio", "--hide-scrollbars",
                 "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
                 "about:blank"]
        self.log = open(profile.parent / "chromium.log", "wb")
        self.process = subprocess.Popen(  # a python trampoline moves the pipe ends to fds 3 and 4, then execs
            [sys.executable, "-c", "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
             "os.execv(sys.argv[3], sys.argv[3:])", str(child_in), str(child_out), binary, *flags],
            pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            start_new_session=True)
        os.close(child_in), os.close(child_out)
        self._buffer = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", {"url": "about:blank"}, timeout=30)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable"):
            self.call(method, session=self.session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=self.session)

    def _message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, "chromium did not answer in time"
            if select.select([self._in], [], [], left)[0]:
                data = os.read(self._in, 1 << 20)
                assert data, f"chromium exited (code {self.process.poll()}); see {self.log.name}"
                self._buffer += data
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 15) -> dict[str, Any]:
        self._id += 1
        command: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            command["sessionId"] = session
        os.write(self._out, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            message = self._message(deadline)
            if message.get("id") == self._id:
                assert "error" not in message, (method, message["error"])
                return message["result"]
            self.events.append(message)

    def page(self, method: str, params: dict[str, Any] | None = None, timeout: float = 15) -> dict[str, Any]:
        return self.call(method, params, session=self.session, timeout=timeout)

    def js(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait(self, expression: str, seconds: float = 30) -> Any:
        deadline = time.monotonic() + seconds
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.05)
        return value

    def type(self, selector: str, text: str) -> None:
        """Focus an element and type into it as a user would (an IME-style insert, then real key events)."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.page("Input.insertText", {"text": text})

    def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13}
        self.page("Input.dispatchKeyEvent", {"type": "keyDown", "text": "\r", **key})
        self.page("Input.dispatchKeyEvent", {"type": "keyUp", **key})

    def click(self, selector: str) -> None:
        box = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                      " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def exceptions(self) -> list[str]:
        return [e["params"]["exceptionDetails"].get("exception", {}).get("description", "?")
                for e in self.events if e.get("method") == "Runtime.exceptionThrown"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout=5)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group this test started (start_new_session)
            self.process.wait(5)
        os.close(self._in), os.close(self._out)
        self.log.close()


@pytest.fixture
def browser(tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium or chromium-browser binary on PATH (Debian: apt-get install -y chromium)")
    chromium = Chromium(binary, tmp_path / "profile")
    yield chromium
    chromium.close()


def reply(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The server's non-streamed answer to the messages with the page's settings."""
    answer = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                        json={"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


RENDERED = """(() => {
  const replies = [...document.querySelectorAll('#output .message.assistant .content')];
  const last = replies[replies.length - 1];
  return {state: document.body.dataset.state, replies: replies.length,
          text: last ? last.textContent : null,
          spans: last ? [...last.children].map((s) => [s.textContent, s.className]) : [],
          users: [...document.querySelectorAll('#output .message.user .content')].map((e) => e.textContent),
          stats: document.getElementById('stats').textContent,
          status: document.getElementById('status').textContent,
          errors: [...document.querySelectorAll('#output .error')].map((e) => e.textContent),
          prompt: document.getElementById('prompt').value};
})()"""


def finished(replies: int) -> str:
    return (f"document.querySelectorAll('#output .message.assistant').length === {replies}"
            " && ['done', 'error'].includes(document.body.dataset.state)")


def test_page_is_public_html_while_the_api_needs_the_key(server):
    page = httpx.get(f"{server}/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    for needle in ('id="output"', 'id="stats"', 'id="prompt"', 'id="send"', "<label"):
        assert needle in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # nothing external: works offline
    assert httpx.get(f"{server}/v1/models").status_code == 401


def test_chat_in_headless_chromium_shows_provenance_stats_and_errors(server, browser, tmp_path):
    browser.page("Page.navigate", {"url": f"{server}/"})
    browser.wait("document.readyState === 'complete' && !!document.getElementById('send')")
    browser.wait("document.getElementById('status').textContent.includes('API key')")  # 401 without a key
    browser.type("#api-key", KEY)
    browser.js("document.getElementById('prompt').focus()")  # leaving the field stores the key and reloads the model
    assert browser.wait("document.getElementById('model').textContent.includes('tiny')")
    assert browser.js("localStorage.getItem('sparrow.apiKey')") == KEY
    browser.js(f"document.getElementById('max-tokens').value = '{MAX_TOKENS}';"
               "document.getElementById('temperature').value = '0'")

    # turn 1: typed, sent with Enter
    browser.type("#prompt", FIRST)
    browser.press_enter()
    browser.wait(finished(1))
    first = browser.js(RENDERED)
    assert first["state"] == "done", first
    expected = reply(server, [{"role": "user", "content": FIRST}])
    text = expected["choices"][0]["message"]["content"]
    assert text and first["text"] == text
    assert "".join(piece for piece, _ in first["spans"]) == text
    kinds = {kind for _, kind in first["spans"]}
    assert kinds == {"drafted", "target"}, first["spans"]  # accepted drafts and the target's own tokens
    assert re.search(r"\b\d+\.\d tokens/s", first["stats"]), first["stats"]
    assert f"{expected['usage']['completion_tokens']} tokens in" in first["stats"], first["stats"]
    # the request's own counts (a drafter's policy may adapt between requests: not compared with `expected`)
    rate, accepted, drafted = re.search(r"acceptance (\d+\.\d)% \((\d+)/(\d+) drafted\)", first["stats"]).groups()
    assert 0 < int(accepted) <= int(drafted) and abs(float(rate) - 100 * int(accepted) / int(drafted)) < 0.051
    assert re.search(r"\d+\.\d\d tokens/step", first["stats"]), first["stats"]
    assert first["prompt"] == ""

    # turn 2: sent with the button; the request carries the whole conversation
    browser.type("#prompt", SECOND)
    browser.click("#send")
    browser.wait(finished(2))
    second = browser.js(RENDERED)
    assert second["state"] == "done", second
    history = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": text},
               {"role": "user", "content": SECOND}]
    assert second["text"] == reply(server, history)["choices"][0]["message"]["content"]
    assert second["users"] == [FIRST, SECOND]
    assert "drafted" in {kind for _, kind in second["spans"]}

    shot = base64.b64decode(browser.page("Page.captureScreenshot", {"format": "png"})["data"])
    path = tmp_path / "playground.png"
    path.write_bytes(shot)
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 10_000
    with Image.open(path) as image:
        assert image.size == (WIDTH, HEIGHT)
        image.verify()

    # a bad setting: the server's 400 is shown and the message comes back for a retry
    browser.js("document.getElementById('max-tokens').value = '0'")
    browser.type("#prompt", "hello")
    browser.press_enter()
    browser.wait(finished(3))
    failed = browser.js(RENDERED)
    assert failed["state"] == "error", failed
    assert "HTTP 400" in failed["status"] and "max_tokens" in failed["status"], failed["status"]
    assert failed["errors"] and "max_tokens" in failed["errors"][-1]
    assert failed["prompt"] == "hello"
    assert browser.exceptions() == []


FAKE_SERVER = r"""(() => {
  // A scripted server: live counters in the chunks, events split across reads at odd places (CRLF line ends),
  // model output that looks like HTML, then an error event mid-stream.
  const events = [
    {choices: [{index: 0, delta: {role: 'assistant', content: ''}, finish_reason: null}]},
    {choices: [{index: 0, delta: {content: 'Hello <b>'}, finish_reason: null}],
     sparrow: {spans: [['Hello ', true], ['<b>', false]], completion_tokens: 3, num_draft_tokens: 4,
               num_accepted_tokens: 2}},
    {choices: [{index: 0, delta: {content: '<img src=x onerror="window.pwned=1">'}, finish_reason: null}],
     sparrow: {spans: [['<img src=x ', true], ['onerror="window.pwned=1">', false]], completion_tokens: 5,
               num_draft_tokens: 8, num_accepted_tokens: 4}},
    {error: {message: 'internal error: boom', type: 'internal_error', param: null, code: null}},
  ];
  const wire = events.map((e) => 'data: ' + JSON.stringify(e) + '\r\n\r\n').join('') + 'data: [DONE]\r\n\r\n';
  const bytes = new TextEncoder().encode(wire);
  window.sentBodies = [];
  window.fetch = async (url, options) => {
    if (String(url).endsWith('v1/models'))
      return new Response(JSON.stringify({object: 'list', data: [{id: 'mock'}]}), {status: 200});
    window.sentBodies.push(JSON.parse(options.body));
    let at = 0;
    const stream = new ReadableStream({async pull(controller) {
      if (at >= bytes.length) { controller.close(); return; }
      const size = 7 + (at % 13);
      controller.enqueue(bytes.slice(at, at + size));
      at += size;
      await new Promise((resolve) => setTimeout(resolve, 1));
    }});
    return new Response(stream, {status: 200, headers: {'content-type': 'text/event-stream'}});
  };
})();"""


def test_live_counters_split_events_escaping_and_a_mid_stream_error(server, browser):
    """The page against a scripted stream (fetch replaced before the page's script runs): what the batched
    scheduler will send (nonzero counters in every chunk), an error event mid-stream, model text that is HTML."""
    browser.page("Page.addScriptToEvaluateOnNewDocument", {"source": FAKE_SERVER})
    browser.page("Page.navigate", {"url": f"{server}/"})
    browser.wait("document.readyState === 'complete' && document.getElementById('model').textContent.includes('mock')")
    browser.type("#prompt", "hi")
    browser.press_enter()
    browser.wait(finished(1))
    page = browser.js(RENDERED)
    assert page["state"] == "error", page
    assert page["text"] == 'Hello <b><img src=x onerror="window.pwned=1">'  # shown as text, never parsed
    assert browser.js("document.querySelectorAll('#output img, #output b').length") == 0
    assert browser.js("window.pwned === undefined")
    assert page["spans"] == [["Hello ", "drafted"], ["<b>", "target"], ["<img src=x ", "drafted"],
                             ['onerror="window.pwned=1">', "target"]]  # runs of one kind merge across chunks
    assert page["errors"] == ["internal error: boom"] and "boom" in page["status"]
    assert re.search(r"\b\d+\.\d tokens/s", page["stats"]) and "5 tokens in" in page["stats"], page["stats"]
    assert "acceptance 50.0% (4/8 drafted)" in page["stats"], page["stats"]
    body = browser.js("window.sentBodies[0]")
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["model"] == "mock"
    assert body["stream"] is True and body["spans"] is True and body["stream_options"] == {"include_usage": True}
    assert browser.exceptions() == []
