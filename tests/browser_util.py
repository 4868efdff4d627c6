"""Headless Chromium (Debian's chromium + chromium-driver) for the tests that look at a page as a person
does: the playground and the documentation site. Importing this skips the test module where the browser
is missing, and fails it under CI (.ci/run installs both)."""

import contextlib
import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not (CHROMIUM and os.path.exists(DRIVER)):
    if os.environ.get("CI"):  # CI installs them (.ci/run): missing there is a failure, not a skip
        pytest.fail("chromium and chromium-driver are not installed", pytrace=False)
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000"]


@contextlib.contextmanager
def chromium(profile_dir):
    """A headless Chromium with its own profile folder, quit on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
