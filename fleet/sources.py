"""Model sources: what `spec.model.source` strings mean, and the list of files each one names.

Owns the one typed parse of a source string, `ModelSource.parse` (its `Scheme` and what the
callers ask of it: is it remote, does the node weight cache fetch it, its directory on this
machine), `parse_source` (a source the weight cache reads, as a `LocalSource`, `HttpSource` or
`HubSource`), the `ModelPlan` a remote source resolves to (files with their URL, size and
digest, and a pinned revision), and the http(s) manifest format (`write_manifest` builds one).
Called by the spec (`fleet.spec.ModelSpec`), the backends (`fleet.local.backend`,
`fleet.k8s.pod_weights`), `fleet.models.read`, `fleet.placement.shapes`, `fleet.agent.cache.WeightCache`
and `fleet cache`; network I/O happens only in `resolve`, through an injected `httpx.Client`
(http) or `huggingface_hub` (hub).

Source strings (docs/node-agent.md has the full description):

- a path (absolute or relative) or ``file:///abs/dir``: weights already on this node, served in
  place (never copied: copying would double the disk they take);
- ``http(s)://host/dir/fleet-manifest.json`` or ``http(s)://host/dir/`` (the manifest is then
  ``fleet-manifest.json`` in that directory): a JSON manifest listing the files,
  ``{"fleetManifest": 1, "files": [{"path": "config.json", "size": 651, "sha256": "<hex>"}]}``,
  each file fetched from its path relative to the manifest's URL (or from its own ``url``);
  ``sha256`` is optional (then the size is the check). The revision is the manifest's sha256, so
  an edited manifest is a new cache entry;
- ``hf://org/name`` or ``hf://org/name@revision`` (default ``main``): a Hugging Face Hub model
  repository, read through `huggingface_hub` (`HfApi.model_info(files_metadata=True)` for the
  file list, LFS sha256 and git blob ids; the revision pinned to the commit it names), from
  ``HF_ENDPOINT`` when set (mirrors) with the token `huggingface_hub.get_token()` finds
  (``HF_TOKEN``, then the token file);
- ``s3://bucket/key``: accepted by the spec and refused by the weight cache, which has no S3
  fetcher (`parse_source` says "unsupported scheme");
- ``sim://PROFILE``: an engine-simulator profile (`fleet.enginesim.profiles`), with
  ``engine.kind: sim`` only; no weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin

MANIFEST_NAME = "fleet-manifest.json"
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# An S3 bucket name: letters, digits, '.', '-' and '_' (AWS allows a subset; S3-compatible stores differ).
_S3_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SourceError(ValueError):
    """A source string that cannot be used, or a remote source that cannot be resolved
    (unreachable, unknown repository or revision, bad manifest). The message names the source."""


class Scheme(str, Enum):
    """The scheme of a model source; a bare path is ``FILE``."""

    FILE = "file"
    HF = "hf"
    S3 = "s3"
    HTTP = "http"
    HTTPS = "https"
    SIM = "sim"

    def remote(self) -> bool:
        """The weights are not on this machine: a backend needs the node weight cache (or, for
        ``hf`` on Kubernetes without one, the engine's own download)."""
        return self in (Scheme.HF, Scheme.S3, Scheme.HTTP, Scheme.HTTPS)

    def cached(self) -> bool:
        """The node weight cache (`fleet.agent.cache`) fetches sources of this scheme."""
        return self in (Scheme.HF, Scheme.HTTP, Scheme.HTTPS)


SCHEME_PREFIXES = tuple(f"{s.value}://" for s in Scheme)
"""Every scheme a source may name, as written (``file://``, ``hf://``, ...): error messages list them."""


@dataclass(frozen=True)
class ModelSource:
    """A `spec.model.source` string, parsed. Pure; build one with `ModelSource.parse`.

    ``text``: the source as written; ``scheme``; ``location``: what the scheme names (``FILE``: the
    path as written, ``file://`` removed, maybe relative; ``HF``: the repository id ``org/name``;
    ``S3``: ``bucket/key``; ``HTTP(S)``: the URL; ``SIM``: the profile name); ``revision``: the hub
    revision after ``@`` (``HF`` only; None when the source names none).
    """

    text: str
    scheme: Scheme
    location: str
    revision: str | None = None

    @staticmethod
    def parse(text: str) -> ModelSource:
        """Parse ``text`` (surrounding blanks ignored). Raises SourceError naming the source and the
        reason: an unknown scheme (with the known ones), ``file://`` with a relative path, a
        malformed hub repository or empty revision, an http(s) URL that names no manifest, an
        ``s3://`` source without a valid bucket and key, ``sim://`` without a profile."""
        return _parse_cached(text)

    @property
    def remote(self) -> bool:
        """See `Scheme.remote`."""
        return self.scheme.remote()

    @property
    def cached(self) -> bool:
        """See `Scheme.cached`."""
        return self.scheme.cached()

    def local_path(self, base_dir: Path | None = None) -> Path | None:
        """The weights directory on this machine (``~`` expanded, a relative path resolved against
        ``base_dir``, the YAML file's directory; default the current one), or None for a remote
        or simulated source. Reads the file system only to resolve a relative path."""
        return _resolve_path(self.location, base_dir) if self.scheme is Scheme.FILE else None


def _resolve_path(location: str, base_dir: Path | None) -> Path:
    path = Path(location).expanduser()
    return path if path.is_absolute() else ((base_dir or Path.cwd()) / path).resolve()


@functools.lru_cache(maxsize=1024)
def _parse_cached(text: str) -> ModelSource:
    s = text.strip()
    prefix, sep, rest = s.partition("://")
    if not sep:
        if not s:
            raise SourceError(f"{text!r}: empty; give a path or one of {', '.join(SCHEME_PREFIXES)}")
        return ModelSource(text, Scheme.FILE, s)
    try:
        scheme = Scheme(prefix)
    except ValueError:
        raise SourceError(f"unsupported scheme {prefix + '://'!r} in {text!r}; use a path or one of "
                          f"{', '.join(SCHEME_PREFIXES)}") from None  # fmt: skip
    if scheme is Scheme.FILE:
        if not rest.startswith("/"):
            raise SourceError(f"{text!r}: a file:// source needs an absolute path (file:///abs/dir)")
        return ModelSource(text, scheme, rest)
    if scheme is Scheme.HF:
        repo, at, revision = rest.partition("@")
        if not _HF_REPO.match(repo) or (at and not revision):
            raise SourceError(f"{text!r}: expected hf://org/name or hf://org/name@revision")
        return ModelSource(text, scheme, repo, revision or None)
    if scheme is Scheme.S3:
        bucket, _, key = rest.partition("/")
        if not _S3_BUCKET.match(bucket) or not key.strip("/"):
            raise SourceError(f"{text!r}: expected s3://bucket/key (a bucket name, then the key of the model's "
                              "directory)")  # fmt: skip
        return ModelSource(text, scheme, rest)
    if scheme is Scheme.SIM:
        if not rest:
            raise SourceError(f"{text!r}: expected sim://PROFILE (an engine-simulator profile)")
        return ModelSource(text, scheme, rest)
    url = s if not s.endswith("/") else s + MANIFEST_NAME
    if not url.split("?", 1)[0].endswith(".json"):
        raise SourceError(
            f"{text!r}: an http(s) source names a manifest (a .json file) or a directory ending in '/' "
            f"that holds {MANIFEST_NAME}; see docs/node-agent.md")
    return ModelSource(text, scheme, url)


@dataclass(frozen=True)
class RemoteFile:
    """One file of a model as its source lists it.

    ``path``: relative path inside the model directory (POSIX, no ``..``); ``url``: where to GET
    it; ``size``: bytes, or None when the source does not say; ``sha256``: hex digest when the
    source gives one; ``git_sha1``: the git blob id of a hub file that is not in LFS (checked as
    ``sha1(b"blob <size>\\0" + content)``).
    """

    path: str
    url: str
    size: int | None
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class ModelPlan:
    """What a remote source resolved to: a pinned ``revision`` and its ``files``.

    ``transfer`` names the downloader (``"http"``: httpx; ``"hub"``: huggingface_hub's
    ``http_get``); ``headers`` go with every file request (the hub token).
    """

    source: str
    revision: str
    files: tuple[RemoteFile, ...]
    transfer: str = "http"
    headers: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass(frozen=True)
class LocalSource:
    """Weights already on this node: a directory used in place."""

    path: Path

    @property
    def canonical(self) -> str:
        return f"file://{self.path}"


@dataclass(frozen=True)
class HttpSource:
    """A manifest on an http(s) server (see the module docstring for the format)."""

    manifest_url: str

    @property
    def canonical(self) -> str:
        return self.manifest_url

    @property
    def identity(self) -> str:
        """What the cache keys an entry by, beside the resolved revision."""
        return self.manifest_url

    def resolve(self, client: Any) -> ModelPlan:
        """GET and check the manifest. ``client``: an ``httpx.Client``.

        Raises SourceError naming the URL on a transport error, an HTTP error or a bad manifest.
        """
        import httpx

        try:
            response = client.get(self.manifest_url, follow_redirects=True)
            response.raise_for_status()
        except httpx.HTTPError as err:
            raise SourceError(f"manifest {self.manifest_url}: {err}") from None
        body = response.content
        try:
            doc = json.loads(body)
        except ValueError as err:
            raise SourceError(f"manifest {self.manifest_url} is not JSON: {err}") from None
        files = parse_manifest(doc, self.manifest_url)
        return ModelPlan(self.manifest_url, hashlib.sha256(body).hexdigest()[:16], files, "http")


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face Hub model repository at a revision (branch, tag or commit)."""

    repo_id: str
    revision: str = "main"

    @property
    def canonical(self) -> str:
        return f"hf://{self.repo_id}@{self.revision}"

    @property
    def identity(self) -> str:
        """What the cache keys an entry by, beside the resolved commit: branch, tag and commit
        names of one commit share the entry."""
        return f"hf://{self.repo_id}"

    def resolve(self, client: Any = None) -> ModelPlan:
        """Ask the hub (``HF_ENDPOINT`` or huggingface.co) for the files at this revision.

        The revision is pinned to the commit sha the hub answers, so a branch that moves is a new
        cache entry. Raises SourceError (unknown repository or revision, no access, unreachable).
        """
        from huggingface_hub import HfApi, get_token, hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
        from huggingface_hub.utils import build_hf_headers

        endpoint = hub_endpoint()
        token = get_token()
        try:
            info = HfApi(endpoint=endpoint, token=token).model_info(
                self.repo_id, revision=self.revision, files_metadata=True)
        except RevisionNotFoundError:
            raise SourceError(f"{self.canonical}: revision {self.revision!r} not found on {endpoint}") from None
        except RepositoryNotFoundError:
            raise SourceError(
                f"{self.canonical}: repository {self.repo_id!r} not found on {endpoint} (or no access: "
                "set HF_TOKEN)") from None
        except (HfHubHTTPError, OSError) as err:
            raise SourceError(f"{self.canonical}: {endpoint} did not answer: {err}") from None
        if not info.sha:
            raise SourceError(f"{self.canonical}: {endpoint} returned no commit sha")
        files = []
        for sib in info.siblings or []:
            _check_relative(sib.rfilename, self.canonical)
            lfs = sib.lfs
            files.append(RemoteFile(
                path=sib.rfilename,
                url=hf_hub_url(self.repo_id, sib.rfilename, revision=info.sha, endpoint=endpoint),
                size=lfs.size if lfs else sib.size,
                sha256=lfs.sha256 if lfs else None,
                git_sha1=None if lfs else sib.blob_id,
            ))
        if not files:
            raise SourceError(f"{self.canonical}: the repository has no files at {info.sha}")
        headers = build_hf_headers(token=token)
        return ModelPlan(self.canonical, info.sha, tuple(files), "hub", headers)


Source = LocalSource | HttpSource | HubSource


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` read now (huggingface_hub reads it once at import), else huggingface.co."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def parse_source(source: str, base_dir: Path | None = None) -> Source:
    """Parse a `spec.model.source` string the weight cache reads (`ModelSource.parse`, then the
    form the cache resolves). Pure.

    ``base_dir`` resolves a relative path (the YAML file's directory; default the current one).
    Raises SourceError naming the source and the reason (``unsupported scheme`` for ``s3://`` and
    ``sim://``, which the cache does not read).
    """
    src = ModelSource.parse(source)
    if src.scheme is Scheme.HF:
        return HubSource(src.location, src.revision or "main")
    if src.scheme in (Scheme.HTTP, Scheme.HTTPS):
        return HttpSource(src.location)
    if src.scheme is not Scheme.FILE:
        raise SourceError(f"{source!r}: unsupported scheme for the weight cache ({src.scheme.value}:// has no "
                          "fetcher); use a path, file://, http(s):// or hf://")  # fmt: skip
    return LocalSource(_resolve_path(src.location, base_dir))


def _check_relative(path: str, where: str) -> str:
    norm = posixpath.normpath(path)
    if (not path or path.startswith("/") or norm.startswith("..") or norm != path
            or "\\" in path or "\0" in path):
        raise SourceError(f"{where}: file path {path!r} must be relative, normalised and stay inside the model")
    return path


def parse_manifest(doc: Any, manifest_url: str) -> tuple[RemoteFile, ...]:
    """The files of a manifest document (see the module docstring). Pure.

    Raises SourceError naming the manifest and the entry (``files[3].size: ...``).
    """
    if not isinstance(doc, dict) or doc.get("fleetManifest") != 1 or not isinstance(doc.get("files"), list):
        raise SourceError(f"manifest {manifest_url}: expected {{\"fleetManifest\": 1, \"files\": [...]}}")
    out, seen = [], set()
    for i, entry in enumerate(doc["files"]):
        where = f"manifest {manifest_url} files[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise SourceError(f"{where}.path: required (a relative path)")
        path = _check_relative(entry["path"], where + ".path")
        if path in seen:
            raise SourceError(f"{where}.path: {path!r} listed twice")
        seen.add(path)
        size = entry.get("size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise SourceError(f"{where}.size: must be a non-negative integer of bytes, got {size!r}")
        sha = entry.get("sha256")
        if sha is not None and (not isinstance(sha, str) or not _HEX64.match(sha)):
            raise SourceError(f"{where}.sha256: must be 64 lower-case hex digits")
        if size is None and sha is None:
            raise SourceError(f"{where}: give size or sha256 (a file with neither cannot be verified)")
        url = entry.get("url") or urljoin(manifest_url, quote(path))
        out.append(RemoteFile(path=path, url=url, size=size, sha256=sha))
    if not out:
        raise SourceError(f"manifest {manifest_url}: no files")
    return tuple(out)


def write_manifest(model_dir: Path, with_sha256: bool = True) -> Path:
    """Write ``fleet-manifest.json`` for every file under ``model_dir`` (hashing each one when
    ``with_sha256``); returns its path. Serve the directory over http(s) and use its URL as the
    source. Used by `fleet cache manifest`, the tests and loadtests/bench_cache_fill.py."""
    files = []
    for p in sorted(model_dir.rglob("*")):
        if not p.is_file() or p.name == MANIFEST_NAME:
            continue
        entry: dict[str, Any] = {"path": p.relative_to(model_dir).as_posix(), "size": p.stat().st_size}
        if with_sha256:
            h = hashlib.sha256()
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            entry["sha256"] = h.hexdigest()
        files.append(entry)
    out = model_dir / MANIFEST_NAME
    out.write_text(json.dumps({"fleetManifest": 1, "files": files}, indent=1) + "\n")
    return out


def redact_source(source: str) -> str:
    """``source`` without credentials, as it may be published (a Node annotation, a log): URL
    userinfo, query and fragment removed (``https://u:p@h/x?X-Amz-Signature=..`` ->
    ``https://h/x``); ``hf://`` sources and paths are returned as they are (they carry none;
    ``hf://org/name@rev``'s ``@`` is a revision). Pure."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" not in source or source.startswith(("hf://", "file://")):
        return source
    parts = urlsplit(source)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
