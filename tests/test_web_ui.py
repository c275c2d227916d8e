"""The web page at `/`, in a real headless Chromium against a real server with an API key.

The page loads without the key, asks for it, then a chat message streams a reply while the
live panel shows the running request; afterwards the panel has TTFT and ITL percentiles. The
routes themselves (page open, `/stats` behind the key, `--disable-web-ui`) are checked
in-process. Chromium and its driver come from Debian (`.ci/run` installs them); without them
the browser test skips locally, and fails under CI.

`python tests/test_web_ui.py --model smollm2 --out docs/images/web-ui.png` takes the README's
screenshot with the same steps (two messages, the second caught while it streams).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pagoda.metrics import LiveStatLogger
from pagoda.server.api import build_app
from pagoda.server.serve import add_serve_parser
from pagoda.server.serving import ServerContext

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server import ServerProcess, start_server  # noqa: E402

KEY = "web-ui-key"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# NOTE: the flags that work on these machines (see the env notes): as root, no sandbox; no
# background networking, whose connections this closed network refuses.
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1280,860"]


def make_driver(user_data_dir: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def text_of(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.ID, element_id).text)


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def unlock(driver: Any, key: str) -> None:
    """Answers the page's API-key dialog."""
    from selenium.webdriver.common.by import By

    wait_for(lambda: driver.find_element(By.ID, "key-dialog").get_attribute("open"),
             what="the API-key dialog")
    driver.find_element(By.ID, "key-input").send_keys(key)
    driver.find_element(By.ID, "key-ok").click()


def start_message(driver: Any, text: str, max_tokens: int) -> Any:
    """Sends `text` from the page; returns the reply's element as soon as it appears."""
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "max_tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant"),
                    what="the reply bubble")[-1]


def send_message(driver: Any, text: str, max_tokens: int) -> dict[str, Any]:
    """Sends `text` from the page; watches the reply and the panel until the reply ends.

    Returns the reply's text, state and meta line, every distinct length the reply had while
    streaming, and every value the panel's running-requests gauge showed meanwhile.
    """
    from selenium.webdriver.common.by import By

    reply = start_message(driver, text, max_tokens)
    lengths, running = set(), set()
    deadline = time.monotonic() + 120
    while reply.get_attribute("data-state") == "streaming" and time.monotonic() < deadline:
        lengths.add(len(reply.find_element(By.CLASS_NAME, "content").text))
        running.add(text_of(driver, "stat-running"))
        time.sleep(0.05)
    return {"state": reply.get_attribute("data-state"),
            "text": reply.find_element(By.CLASS_NAME, "content").text,
            "meta": reply.find_element(By.CLASS_NAME, "meta").text,
            "lengths": lengths, "running": running}


# ---- in-process: the routes ------------------------------------------------------------------
def app_client(web_ui: bool, live: LiveStatLogger | None) -> httpx.AsyncClient:
    ctx = ServerContext(engine=SimpleNamespace(), served_model_names=["tiny"], model_path="tiny",
                        max_model_len=64, api_keys=[KEY])
    transport = httpx.ASGITransport(app=build_app(ctx, live, web_ui=web_ui))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def test_page_is_open_and_stats_need_the_key() -> None:
    asyncio.run(check_page_is_open_and_stats_need_the_key())


async def check_page_is_open_and_stats_need_the_key() -> None:
    async with app_client(True, LiveStatLogger()) as client:
        page = await client.get("/")
        assert page.status_code == 200 and "/ui/app.js" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for asset in ("app.js", "style.css", "favicon.svg"):
            assert (await client.get(f"/ui/{asset}")).status_code == 200, asset
        assert (await client.get("/ui/missing.js")).status_code == 404
        assert (await client.get("/stats")).status_code == 401
        assert (await client.post("/")).status_code in (401, 404, 405)  # only GET is open
        stats = await client.get("/stats", headers={"Authorization": f"Bearer {KEY}"})
        assert stats.status_code == 200
        assert stats.json()["model"] == "tiny" and stats.json()["num_requests_running"] == 0


def test_disable_web_ui_and_no_live_stats() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--disable-web-ui"]).disable_web_ui
    assert not parser.parse_args(["serve"]).disable_web_ui
    asyncio.run(check_no_page_and_no_live_stats())


async def check_no_page_and_no_live_stats() -> None:
    async with app_client(False, None) as client:
        assert (await client.get("/ui/app.js")).status_code == 401  # no page: a gated path
        headers = {"Authorization": f"Bearer {KEY}"}
        assert (await client.get("/", headers=headers)).status_code == 404
        assert (await client.get("/stats", headers=headers)).status_code == 404


# ---- in the browser --------------------------------------------------------------------------
def browser_available() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    reason = browser_available()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="pagoda_chromium_") as profile:
        drv = make_driver(profile)
        try:
            yield drv
        finally:
            drv.quit()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama: Path) -> Iterator[ServerProcess]:
    srv = start_server(tiny_llama, "--dtype", "float32", "--num-kv-blocks", "128",
                       "--api-key", KEY, "--served-model-name", "tiny-web")
    yield srv
    srv.stop()


def test_chat_streams_and_the_panel_shows_the_running_request(
        driver: Any, keyed_server: ServerProcess) -> None:
    driver.get(f"{keyed_server.base_url}/?refresh=200")
    unlock(driver, KEY)
    wait_for(lambda: text_of(driver, "model") == "tiny-web", what="the model name")
    assert text_of(driver, "status") == "connected"

    reply = send_message(driver, "Tell me a long story.", max_tokens=200)
    assert reply["state"] == "done", reply["meta"]
    assert reply["text"], "empty reply"
    # streamed: the page showed the reply at several lengths before it was complete
    assert len({n for n in reply["lengths"] if 0 < n < len(reply["text"])}) >= 2
    tokens = int(re.match(r"(\d+) tokens", reply["meta"]).group(1))
    assert 0 < tokens <= 200
    assert "1" in reply["running"], f"the panel never showed the request: {reply['running']}"

    wait_for(lambda: text_of(driver, "stat-finished") == "1", what="one finished request")
    assert float(text_of(driver, "stat-ttft-p50")) > 0
    assert float(text_of(driver, "stat-itl-p99")) > 0
    assert text_of(driver, "stat-running") == "0"
    errors = [e for e in driver.get_log("browser") if e.get("source") == "javascript"]
    assert not errors, errors


# Delays every key-less /stats answer, so one is always in flight when the dialog is answered.
SLOW_KEYLESS_STATS = """
const realFetch = window.fetch.bind(window);
window.fetch = async (path, options = {}) => {
  const response = await realFetch(path, options);
  const keyless = !(options.headers && options.headers.Authorization);
  if (String(path).endsWith("/stats") && keyless) await new Promise((r) => setTimeout(r, 600));
  return response;
};
"""


def test_a_refusal_of_a_request_sent_before_the_key_does_not_ask_again(
        driver: Any, keyed_server: ServerProcess) -> None:
    """The panel refreshes while the dialog is open; a refusal that arrives after the key was
    given belongs to the key-less request and must not reopen the (modal) dialog."""
    from selenium.webdriver.common.by import By

    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                    {"source": SLOW_KEYLESS_STATS})
    try:
        driver.get(f"{keyed_server.base_url}/?refresh=100")
        driver.execute_script("sessionStorage.clear()")
        driver.refresh()
        unlock(driver, KEY)
        wait_for(lambda: text_of(driver, "model") == "tiny-web", what="the model name")
        time.sleep(1.5)  # the delayed key-less refusals land meanwhile
        assert driver.find_element(By.ID, "key-dialog").get_attribute("open") is None
        assert text_of(driver, "status") == "connected"
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument",
                               {"identifier": script["identifier"]})
        driver.execute_script("sessionStorage.clear()")


def screenshot(model: str, out: Path, prompts: list[str], max_tokens: int) -> None:
    """Serves `model`, asks `prompts` from the page and saves a screenshot to `out` while the
    last reply streams (so the panel shows it running)."""
    srv = start_server(model, "--api-key", KEY)
    try:
        with tempfile.TemporaryDirectory(prefix="pagoda_chromium_") as profile:
            drv = make_driver(profile)
            try:
                drv.set_window_size(1280, 1000)
                drv.get(f"{srv.base_url}/")
                unlock(drv, KEY)
                for prompt in prompts[:-1]:
                    print(send_message(drv, prompt, max_tokens)["meta"])
                start_message(drv, prompts[-1], max_tokens)
                wait_for(lambda: text_of(drv, "stat-running") == "1", what="a running request")
                time.sleep(2.0)  # NOTE: some text, and a panel refresh with its throughput
                out.parent.mkdir(parents=True, exist_ok=True)
                drv.save_screenshot(str(out))
                print(f"wrote {out}")
            finally:
                drv.quit()
    finally:
        srv.stop()


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Screenshot of the web page for the README.")
    cli.add_argument("--model", default="smollm2")
    cli.add_argument("--out", type=Path, default=Path("docs/images/web-ui.png"))
    cli.add_argument("--prompt", action="append", default=None,
                     help="a message to send (repeatable; the screenshot shows the last one "
                          "streaming)")
    cli.add_argument("--max-tokens", type=int, default=200)
    ns = cli.parse_args()
    default = ["What is a KV cache in a language model? Answer briefly.",
               "Write a short poem about a pagoda in the rain."]
    screenshot(ns.model, ns.out, ns.prompt or default, ns.max_tokens)
