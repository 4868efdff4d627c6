"""FROM as a Hugging Face Hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`): the model's folder fetched with
`huggingface_hub` into its cache (safetensors weights, the JSON configs, the tokenizer and the chat
template; never a pickle), and its local path handed on, so every command that takes a folder takes an id.

    resolve(source)      a folder that exists, as it is; a Hub id, as the path of its cached snapshot
    looks_like_hub_id()  "owner/name", where neither it nor its owner is a folder here

Offline (HF_HUB_OFFLINE=1, or no connection) a model already in the cache is used; one that is not is
refused in one line that prints the `hf download` command to run where the Hub can be reached.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import CheckpointError, MissingDependencyError

# what a model folder needs and nothing else: the weights as safetensors, config.json,
# generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json, the index of
# shards, and chat_template.jinja (transformers 5's place for the template)
HUB_FILES = ("*.safetensors", "*.json", "*.jinja")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def looks_like_hub_id(source: str | os.PathLike) -> bool:
    """Whether `source` names a Hub repository rather than a path here: "owner/name" (the Hub's
    characters), and neither it nor its "owner" part exists as a path (runs/mine is a missing run,
    never a repository)."""
    text = os.fspath(source)
    if not _ID.fullmatch(text) or text.endswith((".", "-")) or ".." in text:
        return False
    return not Path(text).exists() and not Path(text.split("/")[0]).exists()


def download_command(repo_id: str) -> str:
    """The `hf download` command that fetches what tinygpt reads of `repo_id` into hf/NAME: an --include a pattern
    (hf reads a second word after one --include as a file name, and then ignores the patterns)."""
    patterns = " ".join(f"--include '{p}'" for p in HUB_FILES)
    return f"hf download {repo_id} {patterns} --local-dir hf/{repo_id.split('/')[1]}"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(source: str | os.PathLike) -> Path:
    """The folder `source` stands for: itself when it is a path (or no Hub id), else the Hub model's
    snapshot in huggingface_hub's cache, fetched when the machine is online.

    Raises:
        CheckpointError: a Hub id that cannot be had (offline and not cached, no such repository, a
            gated one, a network error), with the command that downloads it.
        MissingDependencyError: huggingface_hub is not installed (the hf extra).
    """
    if not looks_like_hub_id(source):
        return Path(source)
    repo_id = os.fspath(source)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise MissingDependencyError(f"{repo_id} is not a folder here; fetching it from the Hugging Face Hub needs "
                                     "huggingface_hub: pip install 'tinygpt[hf]'") from None
    try:
        folder = snapshot_download(repo_id=repo_id, allow_patterns=list(HUB_FILES), local_files_only=_offline())
    except Exception as e:  # offline and not cached, no such repository, gated, a network or disk error
        reason = _reason(e)
        raise CheckpointError(f"{repo_id}: no such folder here, and no Hugging Face Hub model to be had ({reason}); "
                              f"for a Hub model, download it where the Hub can be reached: {download_command(repo_id)}"
                              ) from None
    return Path(folder)


def _reason(e: Exception) -> str:
    name = type(e).__name__
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or _offline():
        return "offline, and it is not in the cache"
    if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return {"RepositoryNotFoundError": "no such model, or a private one",
                "GatedRepoError": "a gated model: accept its terms and log in with `hf auth login`",
                "RevisionNotFoundError": "no such revision"}[name]
    first = str(e).strip().splitlines()[0] if str(e).strip() else name
    return f"{name}: {first[:200]}"
