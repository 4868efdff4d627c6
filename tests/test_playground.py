"""The playground page in a real browser: headless Chromium (Debian's chromium + chromium-driver)
driven by Selenium types a prompt and reads the streamed, probability-coloured text."""

import pytest
import torch
from browser_util import chromium
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from server_util import NAME, running, tiny_model, tiny_tokenizer

import tinygpt
from tinygpt.server import create_app


@pytest.fixture(scope="module")
def url(model, tok):
    with running(create_app(model, tok, model_name=NAME, max_tokens=200)) as base:
        yield base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def set_slider(driver, id: str, value) -> None:
    driver.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input'));", id, str(value))


def text_of(driver, id: str) -> str:
    return driver.find_element(By.ID, id).get_attribute("textContent")


def test_playground_streams_coloured_tokens_with_top5_and_attention(browser, url, model):
    tok = tiny_tokenizer()
    wait = WebDriverWait(browser, 60)
    browser.get(url + "/")
    wait.until(lambda d: f"model {NAME}" in text_of(d, "model-info"))
    set_slider(browser, "temperature", 0)
    set_slider(browser, "max_tokens", 30)
    assert text_of(browser, "max_tokens-val") == "30"
    browser.find_element(By.ID, "prompt").send_keys("hello world")
    browser.find_element(By.ID, "generate").click()
    wait.until(lambda d: text_of(d, "status").startswith("done"))
    assert "30 tokens" in text_of(browser, "status") and "finish reason length" in text_of(browser, "status")

    ids = torch.tensor([tok.encode("hello world")])
    expected = tok.decode(tinygpt.generate(model, ids, 30, greedy=True)[0, ids.shape[1]:].tolist())
    assert text_of(browser, "prompt-echo") == "hello world"
    assert text_of(browser, "completion") == expected

    spans = browser.find_elements(By.CSS_SELECTOR, "#completion .tok")
    assert "".join(s.get_attribute("textContent") for s in spans) == expected
    assert all(s.get_attribute("style").startswith("background") for s in spans)
    ActionChains(browser).move_to_element(spans[3]).perform()
    tip = browser.find_element(By.ID, "tip")
    wait.until(lambda d: tip.is_displayed())
    rows = tip.find_elements(By.CSS_SELECTOR, "tr")
    assert len(rows) == 6  # the chosen token, then the 5 candidates
    assert rows[0].text.startswith(f'chose "{expected[3]}"')
    assert "chosen" in rows[1].get_attribute("class")  # greedy: the chosen token is the most likely
    bars = [int(row.find_element(By.CSS_SELECTOR, "span.bar").get_attribute("style").split("width:")[1].split("px")[0])
            for row in rows[1:]]
    assert bars[0] == 80 and bars == sorted(bars, reverse=True)  # each candidate's bar, relative to the top one

    # the attention view of prompt + output, then another head
    wait.until(lambda d: "tokens" in text_of(d, "attn-status"))
    assert text_of(browser, "attn-status").startswith("layer 0, head 0: 32 tokens (the last 32 of 41)")
    assert int(browser.find_element(By.ID, "attention").get_attribute("width")) > 0
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    wait.until(lambda d: text_of(d, "attn-status").startswith("layer 0, head 1"))


def test_playground_shows_api_errors(browser, url):
    wait = WebDriverWait(browser, 60)
    browser.get(url + "/")
    wait.until(lambda d: f"model {NAME}" in text_of(d, "model-info"))
    browser.find_element(By.ID, "prompt").send_keys("caf\u00e9")  # not in the character vocabulary
    browser.find_element(By.ID, "generate").click()
    wait.until(lambda d: text_of(d, "status").startswith("error"))
    assert "vocabulary" in text_of(browser, "status")


def test_playground_says_when_the_models_vocabulary_cannot_chat(browser):
    from tinygpt.tokenizer import CharTokenizer

    chars = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n")  # no 'U', 'A' or ':' for "User:"/"Assistant:"
    with running(create_app(tiny_model(vocab_size=chars.vocab_size), chars, model_name=NAME)) as base:
        wait = WebDriverWait(browser, 60)
        browser.get(base + "/")
        wait.until(lambda d: f"model {NAME}" in text_of(d, "model-info"))
        note = text_of(browser, "server-note")
        assert note.startswith("no chat") and "cannot express the chat template" in note and "'U'" in note
        browser.find_element(By.ID, "prompt").send_keys("the cat")  # completions still work
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda d: text_of(d, "status").startswith("done"))


def test_playground_chat_tab_for_a_run_with_a_template(browser):
    from server_util import stopping_model

    from tinygpt.tokenizer import render_chat_prompt, with_chat_template

    tok = with_chat_template(tiny_tokenizer())
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello there"}]
    model, expected = stopping_model(tok, render_chat_prompt(tok, messages))
    with running(create_app(model, tok, model_name=NAME, max_tokens=20)) as base:
        wait = WebDriverWait(browser, 60)
        browser.get(base + "/")
        wait.until(lambda d: f"model {NAME}" in text_of(d, "model-info"))
        wait.until(lambda d: d.find_element(By.ID, "tab-chat").is_displayed())
        browser.find_element(By.ID, "tab-chat").click()
        set_slider(browser, "temperature", 0)
        browser.find_element(By.ID, "chat-system").send_keys("Be kind.")
        browser.find_element(By.ID, "chat-input").send_keys("hello there")
        browser.find_element(By.ID, "chat-send").click()
        wait.until(lambda d: text_of(d, "chat-status").startswith("done"))
        assert "finish reason stop" in text_of(browser, "chat-status")  # at the end-of-turn token
        replies = browser.find_elements(By.CSS_SELECTOR, "#chat-log .msg.assistant")
        assert [r.get_attribute("textContent") for r in replies] == [expected]
        # a message the vocabulary cannot write fails alone: it is not kept, and the chat goes on
        browser.find_element(By.ID, "chat-input").send_keys("caf\u00e9")
        browser.find_element(By.ID, "chat-send").click()
        wait.until(lambda d: text_of(d, "chat-status").startswith("error"))
        assert "vocabulary" in text_of(browser, "chat-status")
        browser.find_element(By.ID, "chat-input").send_keys("hello there")
        browser.find_element(By.ID, "chat-send").click()
        wait.until(lambda d: text_of(d, "chat-status").startswith("done"))
        assert browser.execute_script("return chat.messages.map(m => m.role + ':' + m.content)") == [
            "user:hello there", f"assistant:{expected}", "user:hello there",
            f"assistant:{browser.find_elements(By.CSS_SELECTOR, '#chat-log .msg.assistant')[-1].get_attribute('textContent')}"]


def test_playground_has_no_chat_tab_without_a_template(browser, url):
    browser.get(url + "/")
    WebDriverWait(browser, 60).until(lambda d: f"model {NAME}" in text_of(d, "model-info"))
    assert not browser.find_element(By.ID, "tab-chat").is_displayed()
