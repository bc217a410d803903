"""Loading a model's tokenizer: from a local directory, or its files fetched from the hub first.

Owns `load_tokenizer` (tokenizer.json, and tokenizer_config.json and chat_template.jinja when
present, read into a `router.kv.prompt_tokenizer.PromptTokenizer`), `fetch_from_hub` and
`parse_hub_source` (``hf://org/name[@revision]``: the tokenizer files only, never the weights),
the file names, and `TokenizerError`. Blocking (files, network): `router.kv.tokenize.PoolTokenizers`
calls it in a worker thread; the engine simulator (`fleet.enginesim.runner`), tests and
benchmarks call it directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from router.kv.chat_template import compile_chat_template, names_content_loop
from router.kv.prompt_tokenizer import PromptTokenizer
from router.kv.token_segments import SegmentCache

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers (>= 4.43) saves a model's single chat template; it wins over
tokenizer_config.json's ``chat_template`` when both exist, as in transformers' loading."""
HUB_PREFIX = "hf://"
HUB_FILES = (TOKENIZER_FILE, CONFIG_FILE, CHAT_TEMPLATE_FILE)
"""What the router fetches of a hub model (`fetch_from_hub`): the tokenizer, never the weights."""
HUB_TIMEOUT_S = 10.0
"""Seconds huggingface_hub waits for the hub's answer about each file."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a chat template sees (transformers' `SPECIAL_TOKENS_ATTRIBUTES`)."""


class TokenizerError(Exception):
    """A tokenizer directory (or hub source) the router cannot use. ``reason`` is one word for the
    metric label: ``missing`` (no directory or no tokenizer.json; on the hub: no such repository,
    revision or file), ``unreadable`` (an OS error; the hub did not answer), ``invalid``
    (tokenizer.json or tokenizer_config.json that does not parse), ``chat_template`` (a chat
    template that does not compile). The message names the directory and the file."""

    def __init__(self, directory: str, reason: str, message: str) -> None:
        super().__init__(f"tokenizer {directory}: {message}")
        self.directory = directory
        self.reason = reason


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(directory: str, name: str) -> dict[str, Any] | None:
    path = Path(directory) / name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {name}: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise TokenizerError(directory, "invalid", f"{name} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(directory, "invalid", f"{name} is not a JSON object")
    return doc


def _template_source(directory: str, config: Mapping[str, Any]) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named ``default``)."""
    try:
        return (Path(directory) / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {CHAT_TEMPLATE_FILE}: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise TokenizerError(directory, "invalid", f"{CONFIG_FILE}: chat_template is not a string")
    return source


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """``hf://org/name[@revision]`` -> (repository id, revision or None for the default branch).
    Raises TokenizerError (``missing``) for anything else."""
    repo, _, revision = source.removeprefix(HUB_PREFIX).partition("@")
    if not source.startswith(HUB_PREFIX) or repo.count("/") != 1 or not all(repo.split("/")) or (_ and not revision):
        raise TokenizerError(source, "missing", "not an hf://org/name[@revision] source")
    return repo, revision or None


def fetch_from_hub(source: str) -> str:
    """The local directory holding the tokenizer files of the hub model ``source``
    (``hf://org/name[@revision]``), fetched with huggingface_hub's ``hf_hub_download`` (it reads
    ``HF_ENDPOINT`` and ``HF_TOKEN``, and keeps the files in its cache under ``HF_HOME``): the
    `HUB_FILES` only, never the weights; tokenizer.json must exist, the others where the
    repository has them. A router pod (which holds no weights) gets a model's tokenizer this way.
    Blocking (network): call it off the event loop.

    Raises:
        TokenizerError: no such repository, revision or tokenizer.json, or no access
            (``missing``); the hub did not answer or the cache cannot be written (``unreadable``).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = parse_hub_source(source)
    directory: str | None = None
    for name in HUB_FILES:
        try:
            path = hf_hub_download(repo, name, revision=revision, endpoint=os.environ.get("HF_ENDPOINT") or None,
                                   etag_timeout=HUB_TIMEOUT_S)
        except LocalEntryNotFoundError:   # the hub did not answer (after huggingface_hub's retries), not cached
            raise TokenizerError(source, "unreadable", f"{name}: the hub did not answer and the hub cache has "
                                 "no copy") from None  # fmt: skip
        except EntryNotFoundError:
            if name == TOKENIZER_FILE:
                raise TokenizerError(source, "missing", f"the repository has no {TOKENIZER_FILE} (a fast tokenizer "
                                     "is needed)") from None  # fmt: skip
            continue
        except RevisionNotFoundError:
            raise TokenizerError(source, "missing", f"revision {revision!r} not found") from None
        except RepositoryNotFoundError:
            raise TokenizerError(source, "missing", f"repository {repo!r} not found (or no access: set HF_TOKEN "
                                 "in the router's environment)") from None  # fmt: skip
        except (HfHubHTTPError, OSError, ValueError) as exc:
            raise TokenizerError(source, "unreadable", f"{name} not fetched from the hub: {exc}") from None
        directory = directory or str(Path(path).parent)
    assert directory is not None   # tokenizer.json came first, or raised
    return directory


def load_tokenizer(source: str) -> PromptTokenizer:
    """The tokenizer of the model in the directory ``source`` (tokenizer.json; tokenizer_config.json
    and chat_template.jinja when present), or of the hub model ``source`` (``hf://org/name[@rev]``:
    its tokenizer files fetched first, `fetch_from_hub`). Blocking (reads files, builds the Rust
    tokenizer: tens of milliseconds to seconds for a large vocabulary; the network for a hub
    source): call it off the event loop.

    Raises:
        TokenizerError: no such directory or no tokenizer.json (``missing``), a file that cannot
            be read (``unreadable``), one that does not parse (``invalid``), a chat template
            that does not compile (``chat_template``); for a hub source, as `fetch_from_hub`.
    """
    from tokenizers import Tokenizer

    directory = fetch_from_hub(source) if source.startswith(HUB_PREFIX) else source
    root = Path(directory)
    if not root.is_dir():
        raise TokenizerError(directory, "missing", "no such directory")
    if not (root / TOKENIZER_FILE).is_file():
        raise TokenizerError(directory, "missing", f"no {TOKENIZER_FILE} (a fast tokenizer is needed)")
    config = _read_json(directory, CONFIG_FILE) or {}
    try:
        text = (root / TOKENIZER_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {TOKENIZER_FILE}: {exc}") from None
    try:
        description = json.loads(text)
    except ValueError as exc:
        raise TokenizerError(directory, "invalid", f"{TOKENIZER_FILE} is not valid JSON: {exc}") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises plain Exception for a description it cannot use
        raise TokenizerError(directory, "invalid", f"{TOKENIZER_FILE} does not load: {exc}") from None
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    source = _template_source(directory, config)
    template = None
    content_parts = names_developer = False
    if source is not None:
        try:
            template = compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(directory, "chat_template", f"the chat template does not compile: {exc}") from None
        content_parts = names_content_loop(source, template.environment)
        names_developer = '"developer"' in source or "'developer'" in source   # vLLM's own test
    return PromptTokenizer(directory, tokenizer, template, special, content_parts, names_developer,
                           SegmentCache.for_tokenizer(tokenizer, description))  # fmt: skip
