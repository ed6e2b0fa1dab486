"""`/live` in headless Chromium, against a real server (werkzeug, threaded), Kafka, Postgres and
CDC: the page shows a view's snapshot, follows plain-SQL inserts, updates and deletes in place,
resumes with `since` after the server drops it, and shows the server's errors.

What the page shows is compared with what the table holds, read back with SQL."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import requests
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from werkzeug.serving import make_server

from app import close_app, create_app
from app.hub import Hub
from cdc.capture import Capture
from config.settings import Settings, slot_name
from stack.procs import free_port, wait_until
from tests.support import token

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WAIT_S = 60
SHOWN = ("name", "email", "version")  # the columns compared with the table

T = TypeVar("T")
Rows = dict[str, dict[str, str]]

# Read the whole table in one go, so a row replaced meanwhile cannot go stale mid-read.
READ_TABLE = """
return Array.from(document.querySelectorAll("#rows tbody tr")).map((tr) => [
  tr.dataset.key,
  Object.fromEntries(Array.from(tr.cells).map((td) => [td.dataset.column, td.textContent])),
]);
"""


@pytest.fixture(scope="module")
def server(deployment: Settings, capture: Capture) -> Iterator[tuple[str, Hub]]:
    """The API over real HTTP on a free port, once CDC has created its slot (so every change
    from now on reaches the changelogs); heartbeats every half second."""
    with psycopg.connect(deployment.database(), autocommit=True) as conn:
        wait_until(
            lambda: bool(
                conn.execute(
                    "SELECT 1 FROM cdc_slots WHERE slot = %s", (slot_name(deployment),)
                ).fetchone()
            ),
            WAIT_S,
            "CDC to create its slot",
        )
    app = create_app(deployment.model_copy(update={"ws_heartbeat_s": 0.5}))
    port = free_port()
    http = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=http.serve_forever, name="live-page-http", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", app.extensions["logfold.hub"]
    http.shutdown()
    http.server_close()
    thread.join(timeout=10)
    close_app(app)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Debian's Chromium and chromedriver (scripts/bootstrap.sh installs them); both paths are
    given, so selenium-manager never looks for or downloads anything."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            pytest.fail(f"{path} is missing; scripts/bootstrap.sh installs chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # --no-sandbox: Chromium refuses to run as root (as tests do here) with its sandbox on.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # for console errors
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


# -- the tests --------------------------------------------------------------------------------


def test_the_page_shows_the_snapshot_then_follows_inserts_updates_and_deletes(
    server: tuple[str, Hub], browser: WebDriver, deployment: Settings
) -> None:
    url, _ = server
    a, b, c = _keys(3)
    _sql(deployment, *[_insert(k, "Ada", f"{k}@example.com") for k in (a, b)])

    _open(browser, url, token("views:read"))
    _subscribe(browser, "customers")
    headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#rows thead th")]
    assert headers == ["customer_id", "name", "email", "registered_at", "version"]
    _wait_rows(browser, lambda: _table(deployment), "the snapshot")
    assert {a, b} <= set(_page(browser))
    registered = browser.find_element(
        By.CSS_SELECTOR, f'tr[data-key="{a}"] [data-column="registered_at"]'
    )
    assert registered.text.endswith("Z"), registered.text  # rows come in wire form
    row_a = browser.find_element(By.CSS_SELECTOR, f'tr[data-key="{a}"]')

    _sql(deployment, _insert(c, "Grace", f"{c}@example.com"))
    _wait_rows(browser, lambda: _table(deployment), "the inserted row")
    assert _page(browser)[c] == {"name": "Grace", "email": f"{c}@example.com", "version": "0"}

    _sql(
        deployment,
        (
            "UPDATE customers SET email = %s, version = 1 WHERE customer_id = %s",
            ("new@example.com", a),
        ),
    )
    _wait_rows(browser, lambda: _table(deployment), "the updated row")
    assert _page(browser)[a] == {"name": "Ada", "email": "new@example.com", "version": "1"}
    assert row_a.get_attribute("data-key") == a  # updated in place: the same <tr>, not stale
    assert "new@example.com" in row_a.text

    _sql(deployment, ("DELETE FROM customers WHERE customer_id = %s", (b,)))
    _wait_rows(browser, lambda: _table(deployment), "the deleted row to go")
    assert b not in _page(browser)

    assert re.fullmatch(r"\d+\.\d+", browser.find_element(By.ID, "position").text)
    _wait(
        browser,
        lambda page: page.find_element(By.ID, "heartbeat").get_attribute("datetime"),
        "a heartbeat",
    )
    assert browser.find_element(By.ID, "state").text == "Live."
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert "#token=" not in browser.current_url  # dropped from the address bar once read
    # No script errors, no Content-Security-Policy violations.
    console = browser.get_log("browser")  # type: ignore[no-untyped-call]
    assert not [e for e in console if e["level"] == "SEVERE"], console


def test_a_filtered_page_resumes_where_it_left_off_after_the_server_drops_it(
    server: tuple[str, Hub], browser: WebDriver, deployment: Settings
) -> None:
    url, hub = server
    group, other = f"group-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    a, b, c, d = _keys(4)
    _sql(deployment, _insert(a, group), _insert(b, group), _insert(c, other))

    _open(browser, url, token("views:read"))
    _subscribe(browser, "customers", f"name={group}")
    _wait_rows(browser, lambda: _table(deployment, group), "the filtered snapshot")
    assert set(_page(browser)) == {a, b}

    for client in list(hub.clients):  # as the server does with a client that reads too slowly
        client.close(4008, "too far behind")
    _sql(
        deployment,
        ("UPDATE customers SET version = 1 WHERE customer_id = %s", (a,)),
        ("UPDATE customers SET name = %s WHERE customer_id = %s", (other, b)),  # leaves the filter
        ("UPDATE customers SET name = %s WHERE customer_id = %s", (group, c)),  # enters it
        _insert(d, other),  # never concerns the page
    )
    _wait_rows(browser, lambda: _table(deployment, group), "the changes made around the drop")
    assert set(_page(browser)) == {a, c}
    assert _page(browser)[a]["version"] == "1"
    # It resumed from its position (a new snapshot would have set the state to "Live.").
    assert browser.find_element(By.ID, "state").text.startswith("Live (resumed after ")


@pytest.mark.parametrize(
    ("bearer", "code"),
    [("not-a-token", "unauthorized"), (token("commands:write"), "forbidden")],
)
def test_a_bad_token_shows_an_error(
    server: tuple[str, Hub], browser: WebDriver, bearer: str, code: str
) -> None:
    url, _ = server
    _open(browser, url, bearer)
    error = _wait(browser, lambda page: page.find_element(By.ID, "error").text, "an error")
    assert error.startswith(f"{code}: "), error
    assert not browser.find_element(By.ID, "subscribe").is_enabled()
    assert not browser.find_elements(By.CSS_SELECTOR, "#rows tbody tr")


def test_a_filter_the_server_refuses_shows_its_error_and_stops(
    server: tuple[str, Hub], browser: WebDriver
) -> None:
    url, _ = server
    _open(browser, url, token("views:read"))
    _subscribe(browser, "customers", "shoe_size=42")
    error = _wait(browser, lambda page: page.find_element(By.ID, "error").text, "an error")
    assert error.startswith("validation_failed: "), error
    assert "shoe_size" in error
    _wait(
        browser, lambda page: page.find_element(By.ID, "state").text.startswith("Stopped"), "a stop"
    )


def test_the_page_and_its_files_are_served_without_a_token(server: tuple[str, Hub]) -> None:
    url, _ = server
    page = requests.get(f"{url}/live", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["Content-Security-Policy"]
    assert '<script type="module" src="/live/live.js">' in page.text
    script = requests.get(f"{url}/live/live.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["Content-Type"]
    assert '"auth"' in script.text
    for path in ("/live/live.html.bak", "/live/..%2f__init__.py", "/live/nope.js"):
        missing = requests.get(f"{url}{path}", timeout=10)
        assert missing.status_code == 404, path
        assert missing.json()["error"]["code"] == "not_found"


# -- helpers ----------------------------------------------------------------------------------


def _keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}-{i}" for i in range(n)]


def _insert(key: str, name: str, email: str | None = None) -> tuple[str, tuple[Any, ...]]:
    return (
        "INSERT INTO customers (customer_id, name, email, registered_at, version) "
        "VALUES (%s, %s, %s, now(), 0)",
        (key, name, email or f"{key}@example.com"),
    )


def _sql(settings: Settings, *statements: tuple[str, tuple[Any, ...]]) -> None:
    """Each statement in its own transaction, as separate writers would."""
    with psycopg.connect(settings.database(), autocommit=True) as conn:
        for statement, params in statements:
            conn.execute(statement, params)


def _table(settings: Settings, name: str | None = None) -> Rows:
    """What the page should show: the `customers` rows (with that name), as text."""
    query = "SELECT customer_id, name, email, version FROM customers"
    with psycopg.connect(settings.database()) as conn:
        if name is None:
            found = conn.execute(query).fetchall()
        else:
            found = conn.execute(query + " WHERE name = %s", (name,)).fetchall()
    return {k: {"name": n, "email": e, "version": str(v)} for k, n, e, v in found}


def _page(driver: WebDriver) -> Rows:
    """The page's table: data-key -> the compared columns' text."""
    read = driver.execute_script(READ_TABLE)
    return {key: {c: cells[c] for c in SHOWN} for key, cells in read}


def _open(driver: WebDriver, url: str, bearer: str) -> None:
    driver.get(f"{url}/live#token={bearer}")  # the fragment never reaches the server


def _subscribe(driver: WebDriver, view: str, filter: str = "") -> None:
    option = f'#view option[value="{view}"]'
    _wait(driver, lambda page: page.find_elements(By.CSS_SELECTOR, option), f"view {view} listed")
    Select(driver.find_element(By.ID, "view")).select_by_value(view)
    driver.find_element(By.ID, "filter").send_keys(filter)
    driver.find_element(By.ID, "subscribe").click()


def _wait_rows(driver: WebDriver, expected: Callable[[], Rows], what: str) -> None:
    """Until the page's table equals `expected()` (read again on every try)."""
    _wait(driver, lambda page: _page(page) == expected(), what)


def _wait(driver: WebDriver, check: Callable[[WebDriver], T], what: str) -> T:
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(check)
    except TimeoutException:
        state = driver.find_element(By.ID, "state").text
        error = driver.find_element(By.ID, "error").get_attribute("textContent")
        raise AssertionError(
            f"timed out after {WAIT_S}s waiting for {what}; page state {state!r}, "
            f"error {error!r}, rows {_page(driver)}"
        ) from None


def test_over_server_sent_events_the_page_follows_changes_and_resumes_with_last_event_id(
    server: tuple[str, Hub], browser: WebDriver, deployment: Settings
) -> None:
    """The browser's own EventSource: the snapshot, changes in place, and after the server
    ends the stream (too slow), its automatic reconnect with Last-Event-ID resumes it."""
    url, hub = server
    group = f"group-{uuid.uuid4().hex[:8]}"
    a, b, c = _keys(3)
    _sql(deployment, _insert(a, group), _insert(b, group))

    _open(browser, url, token("views:read"))
    Select(browser.find_element(By.ID, "protocol")).select_by_value("sse")
    _subscribe(browser, "customers", f"name={group}")
    _wait_rows(browser, lambda: _table(deployment, group), "the snapshot over SSE")
    _sql(
        deployment,
        ("UPDATE customers SET version = 1 WHERE customer_id = %s", (a,)),
        _insert(c, group),
    )
    _wait_rows(browser, lambda: _table(deployment, group), "the changes over SSE")
    assert re.fullmatch(r"\d+\.\d+", browser.find_element(By.ID, "position").text)

    for client in list(hub.clients):  # as the server does with a stream read too slowly
        client.close(4008, "too far behind")
    _sql(
        deployment,
        ("UPDATE customers SET version = 2 WHERE customer_id = %s", (a,)),
        ("DELETE FROM customers WHERE customer_id = %s", (b,)),
    )
    _wait_rows(browser, lambda: _table(deployment, group), "the changes made around the drop")
    _wait(
        browser,
        lambda page: page.find_element(By.ID, "state").text.startswith("Live (resumed after "),
        "a resume from the last event id, not a new snapshot",
    )
    console = browser.get_log("browser")  # type: ignore[no-untyped-call]
    assert not [e for e in console if e["level"] == "SEVERE"], console


def test_over_server_sent_events_a_refused_filter_shows_its_error_and_stops(
    server: tuple[str, Hub], browser: WebDriver
) -> None:
    url, _ = server
    _open(browser, url, token("views:read"))
    Select(browser.find_element(By.ID, "protocol")).select_by_value("sse")
    _subscribe(browser, "customers", "shoe_size=42")
    error = _wait(browser, lambda page: page.find_element(By.ID, "error").text, "an error")
    assert error.startswith("validation_failed: "), error
    _wait(
        browser, lambda page: page.find_element(By.ID, "state").text.startswith("Stopped"), "a stop"
    )
