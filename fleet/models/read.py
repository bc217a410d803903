"""Read a model's facts from where ``spec.model.source`` says the weights are, without the weights.

Owns `read_model_facts` (source string -> `fleet.models.facts.ModelFacts`) and `ModelSourceError`.
What is read:

- a local directory (a path or ``file://``), or a hub source's directory in Fleet's weight cache
  (the caller looks it up: `fleet.agent.cache.WeightCache.lookup`, no network): ``config.json``; the weight bytes from
  ``model.safetensors.index.json`` ``metadata.total_size``, else the headers of the
  ``*.safetensors`` files (the first 8 + N bytes of each: the tensors' ``data_offsets``), else
  parameters x dtype from ``config.json``;
- ``hf://org/name[@revision]``: ``config.json`` and ``model.safetensors.index.json`` alone, through
  `huggingface_hub` (``hf_hub_download``: ``HF_ENDPOINT``, the hub cache, ``HF_HUB_OFFLINE``); a
  repository with no index gives its weight bytes as the sizes the hub lists for its
  ``*.safetensors`` files (``model_info(files_metadata=True)``). No weights are downloaded.

Sources with nothing to read (``sim://``, ``s3://``, http manifests) give None. `memory_need` puts the facts
together with a deployment's engine arguments and TP size. Called by `fleet validate` and
`fleet plan` (`fleet.cli`), never by the controller's loop (network I/O).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.models.facts import ModelConfigError, ModelFacts, facts_from_config, safetensors_header, safetensors_weight_bytes
from fleet.models.memory import EngineMemorySettings, MemoryNeed
from fleet.sources import HubSource, ModelSource, Scheme, SourceError, hub_endpoint

if TYPE_CHECKING:
    from fleet.spec import InferenceDeployment

INDEX_NAME = "model.safetensors.index.json"
HUB_TIMEOUT_S = 5.0
"""How long `fleet validate` waits for the hub to answer for one file before using its cache."""


class ModelSourceError(ValueError):
    """The model's facts cannot be read: no config.json, unreachable hub, a bad file. The message
    names the source and the file."""


def read_model_facts(source: str, base_dir: Path | None = None, cached_dir: Path | None = None) -> ModelFacts | None:
    """The facts of the model at ``source`` (a `spec.model.source` string), or None for a source
    Fleet does not read (``sim://``, ``s3://``, http(s) manifests).

    ``base_dir`` resolves a relative path (the YAML file's directory); ``cached_dir`` is the
    source's directory in Fleet's weight cache when the caller found one
    (`fleet.agent.cache.WeightCache.lookup`), read instead of the hub.
    Raises ModelSourceError naming the source.
    """
    try:
        src = ModelSource.parse(source)
    except SourceError as err:
        raise ModelSourceError(str(err)) from None
    local = src.local_path(base_dir)
    if local is not None:
        return facts_from_dir(local, source)
    if src.scheme is Scheme.HF:
        if cached_dir is not None:
            return facts_from_dir(cached_dir, source)
        return _facts_from_hub(HubSource(src.location, src.revision or "main"))
    return None


def memory_need(dep: InferenceDeployment, base_dir: Path | None = None,
                cached_dir: Path | None = None) -> MemoryNeed | None:
    """The `MemoryNeed` of one replica of ``dep``: its model's facts (`read_model_facts`), its
    ``spec.engine.args`` and ``env`` (`EngineMemorySettings.from_engine_args`) and its TP size. None for a
    simulated engine or a source Fleet does not read. A CPU replica's need holds no device memory
    to check (placement never fits it to a GPU: `fleet.placement.explain.node_reason`), but its
    ``--max-model-len`` is checked against the model's maximum as on a GPU (`MemoryNeed.max_len_problem`).

    Raises ModelSourceError (the model cannot be read) or EngineArgError (a bad engine flag).
    """
    spec = dep.spec
    if spec.engine.kind == "sim":
        return None
    facts = read_model_facts(spec.model.source, base_dir, cached_dir)
    if facts is None:
        return None
    settings = EngineMemorySettings.from_engine_args(spec.engine.args, spec.engine.env)
    return MemoryNeed(facts, settings, spec.resources.tensor_parallel_size)


def _load_json(path: Path, source: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except OSError as err:
        raise ModelSourceError(f"{source}: cannot read {path.name}: {err.strerror or err}") from None
    except ValueError as err:
        raise ModelSourceError(f"{source}: {path.name} is not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ModelSourceError(f"{source}: {path.name} is not a JSON object")
    return doc


def _index_total(index: dict, source: str) -> int:
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int) or total <= 0:
        raise ModelSourceError(f"{source}: {INDEX_NAME} has no metadata.total_size")
    return total


def facts_from_dir(model_dir: Path, source: str | None = None) -> ModelFacts:
    """Facts of a model directory (config.json, and the safetensors index or headers).

    Raises ModelSourceError (no config.json, an unreadable or bad file) naming the file.
    """
    source = source or str(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{source}: no config.json in {model_dir}")
    try:
        facts = facts_from_config(_load_json(config_path, source), f"{source} config.json")
    except ModelConfigError as err:
        raise ModelSourceError(str(err)) from None
    index = model_dir / INDEX_NAME
    if index.is_file():
        return facts.with_weights(_index_total(_load_json(index, source), source), "safetensors index")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return facts
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                header = safetensors_header(head + fh.read(min(n, 100 * 1024 * 1024)), f.name)
        except OSError as err:
            raise ModelSourceError(f"{source}: cannot read {f.name}: {err.strerror or err}") from None
        except ModelConfigError as err:
            raise ModelSourceError(f"{source}: {err}") from None
        total += safetensors_weight_bytes(header)
    return facts.with_weights(total, "safetensors headers")


def _answers(endpoint: str) -> bool:
    """Whether the hub answers HTTP at all within `HUB_TIMEOUT_S` (any status)."""
    import httpx

    try:
        httpx.head(endpoint, timeout=HUB_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return True


def _cached(src: HubSource, name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(src.repo_id, name, revision=src.revision), str)


def _facts_from_hub(src: HubSource) -> ModelFacts:
    from huggingface_hub import HfApi, get_token, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = hub_endpoint()
    token = get_token()
    where = src.canonical
    online = _answers(endpoint)   # one short probe: huggingface_hub retries an unreachable hub for ~20 s

    def fetch(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(src.repo_id, name, revision=src.revision, endpoint=endpoint, token=token,
                                        etag_timeout=HUB_TIMEOUT_S, local_files_only=not online))
        except LocalEntryNotFoundError:   # offline (HF_HUB_OFFLINE, or the hub unreachable) and not in the hub cache
            raise ModelSourceError(f"{where}: {name} is not in the hub cache and {endpoint} did not answer") from None
        except EntryNotFoundError:
            return None
        except RevisionNotFoundError:
            raise ModelSourceError(f"{where}: revision {src.revision!r} not found on {endpoint}") from None
        except RepositoryNotFoundError:
            raise ModelSourceError(f"{where}: repository {src.repo_id!r} not found on {endpoint} (or no access: "
                                   "set HF_TOKEN)") from None
        except (HfHubHTTPError, OSError, ValueError) as err:
            raise ModelSourceError(f"{where}: {name} not read from {endpoint}: {err}") from None

    config = fetch("config.json")
    if config is None:
        raise ModelSourceError(f"{where}: the repository has no config.json")
    try:
        facts = facts_from_config(_load_json(config, where), f"{where} config.json")
    except ModelConfigError as err:
        raise ModelSourceError(str(err)) from None
    index = fetch(INDEX_NAME) if online or _cached(src, INDEX_NAME) else None
    if index is not None:
        return facts.with_weights(_index_total(_load_json(index, where), where), "safetensors index")
    if not online:
        return facts
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(src.repo_id, revision=src.revision,
                                                                 files_metadata=True)
    except (HfHubHTTPError, OSError, ValueError):
        return facts   # the hub stopped answering: the estimate from config.json
    sizes = [s.size for s in info.siblings or [] if s.rfilename.endswith(".safetensors") and s.size]
    return facts.with_weights(sum(sizes), "safetensors file sizes") if sizes else facts
