"""The documentation site as a reader meets it: `mkdocs build --strict` (what `make docs` runs) builds it,
and headless Chromium opens its pages over HTTP, finds the navigation and the search box, searches, and
takes a screenshot of the home page and a tutorial."""

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")
pytest.importorskip("material", reason="the docs extra (pip install -e '.[docs]') builds the site")

from browser_util import chromium  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tinygpt import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def url(site):
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def test_the_cli_reference_holds_every_command_as_its_parser_prints_it(site):
    page = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    import argparse

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) >= 20
    for name in commands:
        assert f"tinygpt {name}</code>" in page, f"the CLI reference lacks `tinygpt {name}`"
    assert "--max-time" in page and "usage: tinygpt train" in page


def test_the_api_reference_is_made_from_the_docstrings(site):
    import tinygpt

    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in tinygpt.__all__:
        assert f'id="tinygpt.{tinygpt._HOME[name]}.{name}"' in page, f"the API reference lacks {name}"
    first_line = tinygpt.generate.__doc__.strip().splitlines()[0]
    assert first_line.split()[0] in page


def test_the_site_opens_in_a_browser_with_navigation_and_search(browser, url, tmp_path):
    wait = WebDriverWait(browser, 60)
    browser.get(url + "/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary"))
    assert browser.title.endswith("tinygpt")
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")]
    assert any(link.endswith("/reference/cli/") for link in links), links
    assert browser.save_screenshot(str(tmp_path / "home.png")) and (tmp_path / "home.png").stat().st_size > 10_000

    search = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    search.click()
    search.send_keys("chinchilla")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))

    browser.get(url + "/reference/cli/")
    wait.until(lambda d: "tinygpt train" in d.find_element(By.CSS_SELECTOR, "article").text)
    assert browser.save_screenshot(str(tmp_path / "page.png")) and (tmp_path / "page.png").stat().st_size > 10_000
