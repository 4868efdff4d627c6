"""`tinygpt serve` as a process: it serves, drains on SIGTERM, and refuses bad setups in one line."""

import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_util import save_tiny_run, wait_for

from tinygpt.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return save_tiny_run(tmp_path_factory.mktemp("serve") / "tiny")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line_error(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    for f in fragments:
        assert f in err[0], err[0]


def test_sigterm_drains_running_streams_then_exits(run, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    # one intra-op thread: a tiny model gains nothing from more, and on a busy machine they thrash
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "serve", str(run), "--port", str(port),
                             "--max-tokens", "100000", "--device", "cpu", "--threads", "1",
                             "--allow-host", "tinygpt.test"], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        def up():
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # exited: fail below

        wait_for(up, timeout=60, interval=0.1)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        # bound to 127.0.0.1: only loopback names, and the one --allow-host adds (DNS rebinding)
        for host, status in (("attacker.example", 421), (f"attacker.example:{port}", 421), ("tinygpt.test", 200),
                             (f"localhost:{port}", 200), (f"[::1]:{port}", 200)):
            assert httpx.get(url + "/health", headers={"Host": host}, timeout=5).status_code == status, host
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        draining = wait_for(lambda: (r := httpx.get(url + "/health", timeout=5)).status_code == 503 and r)
        assert draining.json()["status"] == "draining"
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
        assert reader.is_alive(), "the stream should still be running while the server drains"
        reader.join(300)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) for c in chunks) == 1500
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "serve.log").read_text()
    assert f"http://127.0.0.1:{port}/v1" in out


def test_missing_serve_extra_says_how_to_install(run):
    # `import tinygpt` and the CLI never import the server, so the extra stays optional
    code = ("import sys, tinygpt, tinygpt.cli; "
            "print([m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]); "
            f"sys.modules['fastapi'] = None; sys.exit(tinygpt.cli.main(['serve', {str(run)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout.strip() == "[]"
    assert r.stderr.strip().splitlines() == ["tinygpt: error: tinygpt serve needs FastAPI and uvicorn: "
                                             "pip install 'tinygpt[serve]'"]


def test_bad_setups_are_one_line_errors(run, tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    one_line_error(capsys, "missing")
    assert main(["serve", str(run), "--port", "70000"]) == 2
    one_line_error(capsys, "--port")
    assert main(["serve", str(run), "--max-concurrency", "0"]) == 2
    one_line_error(capsys, "--max-concurrency")
    for threads in ("0", "5000000000"):  # torch takes a C int: a huge count was an 'Overflow' from deep inside
        assert main(["serve", str(run), "--threads", threads]) == 2
        one_line_error(capsys, "--threads")
    assert main(["serve", str(run), "--allow-host", "http://my.host/"]) == 2
    one_line_error(capsys, "--allow-host")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(run), "--port", str(port)]) == 2
        one_line_error(capsys, f"cannot listen on 127.0.0.1:{port}")



def test_a_kv_cache_the_machine_cannot_hold_is_refused_before_listening(run):
    """Once: the model thread died allocating it after "serving" was printed; requests hung, /health said ok."""
    r = subprocess.run([sys.executable, "-m", "tinygpt", "serve", str(run), "--port", "0", "--device", "cpu",
                        "--max-concurrency", "20000000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    # (a note that another test's process is compiling the CPU kernels may come first: not the error)
    lines = [line for line in r.stderr.strip().splitlines() if "compiling its CPU kernels" not in line]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "KV cache for 20,000,000 concurrent sequences" in lines[0] and "lower --max-concurrency" in lines[0]
    assert "needs 305.2 GiB" in lines[0]  # 2 (keys, values) x 2 layers x 32 positions x 32 wide x 4 bytes each
