"""The playground page in a real headless Chromium against the real local application.

Starts Ray + the Serve application (configs/local.yaml, CPU), opens `GET /` in Debian's
`chromium` driven by Selenium through Debian's `chromium-driver`, and checks that
  * a run with speculation on renders tokens of both origins, and the figures shown equal
    the response's `usage.speculation` (the page exposes the last usage on data-usage);
  * the side-by-side mode runs off and on at once and shows a speed-up (docs/playground.png);
  * at 360 px wide nothing overflows horizontally, and Tab / Enter / Ctrl+Enter reach and
    submit the form with a visible focus ring.
Skips (with the reason) where chromium, chromedriver or selenium is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.serve]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not CHROMIUM:
    pytest.skip("chromium is not installed (apt-get install -y chromium)", allow_module_level=True)
if not CHROMEDRIVER:
    pytest.skip("chromedriver is not installed (apt-get install -y chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tests/e2e is not a package: make `tests.serve` importable
    sys.path.insert(0, str(ROOT))

from tests.serve.conftest import deployed, free_port  # noqa: E402

SCREENSHOT = ROOT / "docs" / "playground.png"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
RUN_TIMEOUT_S = 180


# ---- the application ------------------------------------------------------------------------
def _serve_http_port() -> int:
    from ray.serve.context import _get_global_client

    return int(_get_global_client().http_config.port)


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    """The default local application; on a Ray this process already runs, else on its own.
    SPECSERVE_PLAYGROUND_URL=http://127.0.0.1:8000 points the test at a running server instead."""
    if os.environ.get("SPECSERVE_PLAYGROUND_URL"):
        yield os.environ["SPECSERVE_PLAYGROUND_URL"].rstrip("/")
        return
    ray = pytest.importorskip("ray")
    from ray import serve

    own = not ray.is_initialized()
    if own:
        port = free_port()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    else:
        serve.start()  # no-op when Serve runs; its HTTP options stay as they are
        port = _serve_http_port()
    try:
        with deployed(port) as base:
            yield base
    finally:
        if own:
            serve.shutdown()
            ray.shutdown()


# ---- the browser ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(app_url: str) -> Iterator[Any]:
    profile = tempfile.mkdtemp(prefix="specserve-chromium-")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", "--force-color-profile=srgb",
                 "--window-size=1200,900", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _viewport(driver, width: int, height: int) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 500})


def _open(driver, app_url: str, width: int = 1200, height: int = 900) -> None:
    _viewport(driver, width, height)
    driver.get(f"{app_url}/")
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    assert driver.find_element(By.CSS_SELECTOR, "h1").text == "specserve playground"


def _fill(driver, *, prompt: str = PROMPT, speculation: str = "on", k: str = "4", temperature: str = "0",
          max_tokens: str = "64", compare: bool = False) -> None:
    for field, value in (("prompt", prompt), ("k", k), ("temperature", temperature), ("max-tokens", max_tokens)):
        el = driver.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    Select(driver.find_element(By.ID, "speculation")).select_by_value(speculation)
    box = driver.find_element(By.ID, "compare")
    if box.is_selected() != compare:
        box.click()


def _wait_finished(driver, runs_before: int, expected_runs: int) -> list[Any]:
    def finished(d):
        return int(d.execute_script("return Number(document.body.dataset.finished || 0)")) > runs_before

    try:
        WebDriverWait(driver, RUN_TIMEOUT_S, poll_frequency=0.2).until(finished)
    except TimeoutException:
        states = [s.get_attribute("data-state") for s in driver.find_elements(By.CSS_SELECTOR, "section.run")]
        raise AssertionError(f"the stream did not finish in {RUN_TIMEOUT_S} s (states {states})") from None
    runs = driver.find_elements(By.CSS_SELECTOR, "#runs section.run")
    assert len(runs) == expected_runs
    for run in runs:
        status = run.find_element(By.CSS_SELECTOR, ".status").text
        assert run.get_attribute("data-state") == "done", status
    return runs


def _finished_count(driver) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.finished || 0)"))


def _fig(run, name: str) -> str:
    return run.find_element(By.CSS_SELECTOR, f'[data-fig="{name}"]').text


# The page's formatting, in Python: what it must display for a given usage.speculation.
def _to_fixed(x: float, digits: int) -> str:
    """JavaScript's Number.prototype.toFixed: the double's exact value, ties away from zero.
    Python's format rounds ties to even (f"{7.125:.2f}" is '7.12'; the page shows '7.13')."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _pct(x: float | None) -> str:
    return "—" if x is None else _to_fixed(100 * x, 1) + "%"


def _num2(x: float | None) -> str:
    return "—" if x is None else _to_fixed(x, 2)


def _check_run_matches_usage(run) -> dict[str, Any]:
    usage = json.loads(run.get_attribute("data-usage"))
    client = json.loads(run.get_attribute("data-client"))
    spec = usage["speculation"]
    # tokens rendered, by origin, against what the server accounted
    draft = run.find_elements(By.CSS_SELECTOR, ".output .tok.draft")
    target = run.find_elements(By.CSS_SELECTOR, ".output .tok.target")
    assert len(draft) + len(target) == usage["completion_tokens"] == client["completion_tokens"]
    assert client["draft_tokens"] == len(draft) and client["target_tokens"] == len(target)
    assert len(draft) <= spec["accepted_tokens"]
    if client["finish_reason"] == "length":  # no step was cut short by EOS
        assert len(draft) == spec["accepted_tokens"]
    if client["drafted_tokens"] is not None:  # the server sends per-step counts: the page sums them
        assert (client["drafted_tokens"], client["num_drafts"], client["accepted_tokens"]) == (
            spec["drafted_tokens"], spec["num_drafts"], spec["accepted_tokens"])
    assert _fig(run, "check").startswith("✓"), _fig(run, "check")
    # the figures shown are usage.speculation's
    assert _fig(run, "decision").startswith("speculate" if spec["mode"] == "speculative" else "plain")
    assert _fig(run, "reason") == spec["reason"]
    assert _fig(run, "k") == str(spec["k"])
    assert _fig(run, "drafted") == str(spec["drafted_tokens"])
    assert _fig(run, "accepted") == str(spec["accepted_tokens"])
    assert _fig(run, "acceptance_rate") == _pct(spec["acceptance_rate"])
    assert _fig(run, "mean_acceptance_length") == _num2(spec["mean_acceptance_length"])
    assert _fig(run, "tokens") == str(usage["completion_tokens"])
    # client-side timings are present and sane
    assert client["ttft_s"] is not None and 0 < client["ttft_s"] < RUN_TIMEOUT_S
    assert _fig(run, "ttft").endswith(" ms")
    if usage["completion_tokens"] > 1:
        assert client["decode_tokens_per_s"] and client["decode_tokens_per_s"] > 0
        assert float(_fig(run, "tps")) > 0
    return usage


# ---- tests ---------------------------------------------------------------------------------------
def test_speculation_on_shows_both_origins_and_usage_figures(browser, app_url: str) -> None:
    _open(browser, app_url)
    _fill(browser, speculation="on")
    before = _finished_count(browser)
    browser.find_element(By.ID, "run").click()
    (run,) = _wait_finished(browser, before, 1)
    usage = _check_run_matches_usage(run)
    spec = usage["speculation"]
    assert spec["mode"] == "speculative" and spec["requested"] == "on" and spec["drafted_tokens"] > 0
    assert run.find_elements(By.CSS_SELECTOR, ".output .tok.draft"), "no draft-accepted token rendered"
    assert run.find_elements(By.CSS_SELECTOR, ".output .tok.target"), "no target token rendered"
    out = run.find_element(By.CSS_SELECTOR, ".output")
    assert out.get_attribute("aria-live") == "polite" and out.get_attribute("aria-busy") == "false"


def test_chat_mode_streams(browser, app_url: str) -> None:
    _open(browser, app_url)
    browser.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="chat"]').click()
    _fill(browser, prompt="Write a function that adds two numbers.", speculation="on", max_tokens="32")
    before = _finished_count(browser)
    browser.find_element(By.ID, "run").click()
    (run,) = _wait_finished(browser, before, 1)
    _check_run_matches_usage(run)


def test_side_by_side_off_and_on(browser, app_url: str) -> None:
    _open(browser, app_url, 1200, 900)
    _fill(browser, speculation="auto", compare=True, max_tokens="96")
    before = _finished_count(browser)
    browser.find_element(By.ID, "run").click()
    off, on = _wait_finished(browser, before, 2)
    assert off.get_attribute("data-label") == "off" and on.get_attribute("data-label") == "on"
    u_off, u_on = _check_run_matches_usage(off), _check_run_matches_usage(on)
    assert u_off["speculation"]["mode"] == "plain" and u_off["speculation"]["requested"] == "off"
    assert not off.find_elements(By.CSS_SELECTOR, ".output .tok.draft")
    assert u_on["speculation"]["mode"] == "speculative" and u_on["speculation"]["requested"] == "on"
    summary = browser.find_element(By.ID, "summary")
    assert summary.is_displayed()
    speedup = browser.find_element(By.ID, "sum-speedup")
    assert float(speedup.get_attribute("data-value")) > 0
    assert speedup.text.endswith("×")
    assert browser.find_element(By.ID, "sum-same").text  # greedy: usually "yes" (batched float math may differ)
    _save_screenshot(browser)


def test_narrow_viewport_and_keyboard_only(browser, app_url: str) -> None:
    _open(browser, app_url, 360, 780)
    overflow = """
        const w = document.documentElement.clientWidth;
        const wide = [...document.querySelectorAll('body *')].filter((e) => {
          const r = e.getBoundingClientRect();
          return r.width > 0 && (r.right > w + 0.5 || r.left < -0.5) && !e.closest('.skip');
        }).map((e) => e.tagName + (e.id ? '#' + e.id : ''));
        return [document.documentElement.scrollWidth, w, wide];"""
    scroll_w, client_w, wide = browser.execute_script(overflow)
    assert client_w == 360 and scroll_w <= client_w and not wide, (scroll_w, client_w, wide)

    # Keyboard only: Tab from the top reaches every control in order, with a visible focus ring.
    _open(browser, app_url, 360, 780)  # fresh page: Tab starts at the top of the document
    ActionChains(browser).send_keys(Keys.TAB).perform()
    seen = []
    for _ in range(20):
        info = browser.execute_script("""
            const e = document.activeElement, s = getComputedStyle(e);
            return [e.id || e.name || e.tagName, s.outlineStyle, parseFloat(s.outlineWidth)];""")
        seen.append(info[0])
        if info[0] != "BODY":
            assert info[1] != "none" and info[2] >= 2, f"no visible focus on {info[0]}: {info}"
        if info[0] == "run":
            break
        ActionChains(browser).send_keys(Keys.TAB).perform()
    order = [s for s in seen if s in ("mode", "prompt", "speculation", "k", "temperature", "max-tokens",
                                      "seed", "compare", "run")]
    assert order == ["mode", "prompt", "speculation", "k", "temperature", "max-tokens", "seed", "compare", "run"], seen

    # Enter on the focused Run button submits ...
    before = _finished_count(browser)
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    (run,) = _wait_finished(browser, before, 1)
    assert json.loads(run.get_attribute("data-usage"))["completion_tokens"] > 0
    # ... and so does Ctrl+Enter from the prompt box.
    prompt = browser.find_element(By.ID, "prompt")
    prompt.click()
    before = _finished_count(browser)
    prompt.send_keys(Keys.CONTROL, Keys.ENTER)
    (run,) = _wait_finished(browser, before, 1)
    _check_run_matches_usage(run)
    scroll_w, client_w, wide = browser.execute_script(overflow)
    assert scroll_w <= client_w and not wide, (scroll_w, client_w, wide)


def _save_screenshot(driver) -> None:
    """docs/playground.png: the side-by-side view, palette-quantized to stay small."""
    driver.execute_script("document.querySelectorAll('.output').forEach((o) => { o.scrollTop = 0; });"
                          "window.scrollTo(0, 0); document.activeElement.blur();")
    png = driver.get_screenshot_as_png()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    try:
        import io

        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB")
        image = image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        buf = io.BytesIO()
        image.save(buf, format="PNG", optimize=True)
        png = buf.getvalue()
    except ImportError:
        pass
    tmp = SCREENSHOT.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_bytes(png)
    tmp.replace(SCREENSHOT)
