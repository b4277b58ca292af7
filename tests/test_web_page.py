"""Issue 53, parts 1 and 3: the page at `/`, in a real headless browser (Debian's Chromium and
chromedriver, which the test command installs as it installs Redis, driven by selenium).

Against a real `kvserve serve` with an API key and an admin key: the page asks for the key,
a chat round trip streams an answer, a second request with the same long prompt shows a cache
hit in the panel (the last request's cached tokens, the hit rate), the admin sees the prefix
tree and an ordinary key does not, no console errors, and a screenshot is kept
(`$KVSERVE_TEST_ARTIFACTS`, default `test-artifacts/` at the repo root). Hostile content stays
text: `<script>`, `<img onerror>` and markdown-link payloads sent through the chat (and so into
the admin's prefix tree) leave no element of their own in the DOM, run nothing, and the page
carries a Content Security Policy. The gateway serves the same page with its replicas.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

from kvserve.model_loader.make_model import ensure_default_model

pytestmark = pytest.mark.timeout(600)

KEY, ADMIN = "sk-web-user", "sk-web-admin"
ARTIFACTS = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS",
                                Path(__file__).resolve().parent.parent / "test-artifacts"))
LONG = " ".join(f"Fact {i}: the cache keeps whole blocks of sixteen tokens." for i in range(25))
HOSTILE = ('<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
           '[click me](javascript:window.__pwned=3) <b>bold</b> &lt;tag&gt;')


def _chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("chromium and chromedriver are not installed: `make test` installs them "
                    "with apt-get (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("web", [str(ensure_default_model()), "--served-model-name", "tiny",
                                "--api-key", KEY, "--admin-api-key", ADMIN,
                                "--disable-log-stats"], tmp_path_factory.mktemp("web-logs"),
                        max_model_len=2048)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture()
def browser():
    driver = _chrome()
    try:
        yield driver
    finally:
        driver.quit()


def _wait(predicate, timeout: float = 60.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # an element not there yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout} s (last: {last!r})")


def _login(browser, url: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    _wait(lambda: browser.find_element(By.ID, "key-form").is_displayed(), what="the key form")
    browser.find_element(By.ID, "key-input").send_keys(key)
    browser.find_element(By.CSS_SELECTOR, "#key button").click()
    _wait(lambda: browser.find_element(By.ID, "status").text == "ready", what="ready")


def _chat(browser, text: str) -> str:
    """Send one message; the assistant's streamed answer once its usage line arrived."""
    from selenium.webdriver.common.by import By

    before = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
    box = browser.find_element(By.ID, "prompt")
    browser.execute_script("arguments[0].value = arguments[1]", box, text)
    browser.find_element(By.ID, "send").click()
    _wait(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")) > before,
          what="the streamed answer")
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")[-1].text


def _console_errors(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_chat_streams_and_the_panel_shows_the_hit(server, browser):
    from selenium.webdriver.common.by import By

    _login(browser, server.url, ADMIN)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("8")
    answer = _chat(browser, LONG)
    assert answer.strip()
    first = int(browser.find_element(By.ID, "last-cached").text)
    browser.find_element(By.ID, "clear").click()
    _chat(browser, LONG)  # the same conversation again: its prompt is cached now
    cached = int(browser.find_element(By.ID, "last-cached").text)
    prompt = int(browser.find_element(By.ID, "last-prompt").text)
    assert cached > first and cached >= prompt - 16, (first, cached, prompt)
    assert "device" in browser.find_element(By.ID, "last-sources").text
    _wait(lambda: "served from the cache" in browser.find_element(By.ID, "hit-rate").text,
          what="the hit rate")
    _wait(lambda: browser.find_element(By.ID, "tree-panel").is_displayed()
          and "Fact 0" in browser.find_element(By.ID, "tree").text, what="the prefix tree")
    assert browser.find_element(By.ID, "role").text == "admin view"
    _wait(lambda: "% of the KV pool" in browser.find_element(By.ID, "pool-now").text,
          what="the pool gauge")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "web_page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    assert not _console_errors(browser)


def test_an_ordinary_key_sees_no_tree_and_a_wrong_key_is_refused(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    _wait(lambda: browser.find_element(By.ID, "key-form").is_displayed(), what="the key form")
    browser.find_element(By.ID, "key-input").send_keys("sk-wrong")
    browser.find_element(By.CSS_SELECTOR, "#key button").click()
    _wait(lambda: "refused" in browser.find_element(By.ID, "key-error").text,
          what="the refusal")
    browser.find_element(By.ID, "key-input").clear()
    _login(browser, server.url, KEY)
    _chat(browser, "hello")
    time.sleep(2.5)  # a refresh of the panel
    assert not browser.find_element(By.ID, "tree-panel").is_displayed()
    assert browser.find_element(By.ID, "role").text == ""
    assert not _console_errors(browser)


def test_hostile_content_stays_text(server, browser):
    from selenium.webdriver.common.by import By

    _login(browser, server.url, ADMIN)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("4")
    _chat(browser, HOSTILE)
    user = browser.find_elements(By.CSS_SELECTOR, ".msg.user .text")[-1]
    assert user.text == HOSTILE  # shown as sent, character for character
    log = browser.find_element(By.ID, "chat-log")
    for tag in ("script", "img", "a", "b"):
        assert not log.find_elements(By.TAG_NAME, tag), tag
    # the admin's prefix tree shows the same prompt's text: as text too
    _wait(lambda: "<script>window" in browser.find_element(By.ID, "tree").text,
          what="the hostile prompt in the tree")
    tree = browser.find_element(By.ID, "tree")
    for tag in ("script", "img", "a", "b"):
        assert not tree.find_elements(By.TAG_NAME, tag), tag
    assert browser.execute_script("return window.__pwned === undefined")
    assert len(browser.find_elements(By.TAG_NAME, "script")) == 1  # the page's own
    assert not _console_errors(browser)


def test_the_page_sets_a_content_security_policy(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "object-src 'none'" in csp
    assert "unsafe-inline" not in csp
    js = httpx.get(server.url + "/static/app.js")
    assert js.status_code == 200 and js.headers["x-content-type-options"] == "nosniff"
    assert "innerHTML" not in js.text and "insertAdjacentHTML" not in js.text
    assert httpx.get(server.url + "/static/../app.py").status_code == 404


def test_the_gateway_serves_the_page_with_its_replicas(server, tmp_path, browser):
    import subprocess
    import sys

    from selenium.webdriver.common.by import By
    from kvserve.utils.ports import free_port

    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    gw = subprocess.Popen([sys.executable, "-m", "kvserve.entrypoints.cli", "route", "--replica",
                           server.url, "--port", str(port), "--admin-api-key", ADMIN],
                          stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(url + "/health", timeout=2).status_code == 200,
              what="the gateway")
        _login(browser, url, KEY)
        _wait(lambda: browser.find_element(By.ID, "replicas-panel").is_displayed(),
              what="the replicas panel")
        assert server.url in browser.find_element(By.ID, "replicas").text
        assert _chat(browser, "hello through the gateway") is not None
    finally:
        gw.terminate()
        gw.wait(15)
        log.close()
