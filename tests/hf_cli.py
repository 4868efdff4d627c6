"""What the `hf` command line would fetch for a command tinygpt prints, read by hf's own parser."""
import shlex
import sys

import pytest


class _Fetched(Exception):
    pass


def fetched_patterns(command: str, monkeypatch) -> list[str] | None:
    """The glob patterns `hf download` fetches for `command` (its download functions replaced; None: every file).
    A word hf reads as a file name fails: hf then ignores the --include patterns."""
    from huggingface_hub.cli import download, hf

    def snapshot(**kw):
        raise _Fetched(kw["allow_patterns"])

    def one_file(**kw):
        raise AssertionError(f"hf reads {kw['filename']!r} as a file name")

    monkeypatch.setattr(download, "snapshot_download", snapshot)
    monkeypatch.setattr(download, "hf_hub_download", one_file)
    monkeypatch.setattr(sys, "argv", shlex.split(command))
    with pytest.raises(_Fetched) as e:
        hf.main()
    return e.value.args[0]
