"""Runs `tinygpt` command lines against hostile folders in one fresh process and reports, for each:
the exit code, what was printed on stderr, the peak memory the command took and how long it ran.

    python hostile_worker.py CASES.json RESULTS.json

CASES.json is a list of {"name", "argv", "marker"}. Each command runs through cli.main() as the
`tinygpt` script would run it; an exception that escapes main() is recorded as a traceback would
be. Peak memory is the rise of this process's resident set during the command: the kernel's
high-water mark (VmHWM) is reset before each one (/proc/self/clear_refs), so each command is
measured alone. A command still running after 30 s is stopped and recorded as a hang.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback


def _status(key: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak resident set size to the current one
        return True
    except OSError:
        return False


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def run(case: dict) -> dict:
    from tinygpt import cli

    measured = _reset_peak()
    before = _status("VmRSS:")
    err, out = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    signal.alarm(30)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main(case["argv"])
    except _Hang:
        code = "hang"
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the real script would show as a traceback
        code = "traceback"
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    elapsed = time.perf_counter() - started
    peak = _status("VmHWM:") - before if measured else None
    return {"name": case["name"], "code": code, "stderr": err.getvalue(), "stdout": out.getvalue()[-500:],
            "peak_bytes": peak, "seconds": elapsed, "marker": os.path.exists(case["marker"])}


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    import torch

    torch.set_num_threads(1)
    import tinygpt.cli  # noqa: F401  (imported before measuring: the import is not the command's memory)

    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = [run(case) for case in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
