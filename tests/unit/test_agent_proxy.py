"""The weight cache's http(s) sources through a forward proxy taken from the environment
(``http_proxy`` / ``https_proxy`` / ``no_proxy``), as curl and httpx take it: the manifest
(httpx) and the files (fleet.agent.transports.HttpTransfer) both go through it. The proxy is a
stand-in (tests/support/forward_proxy.py); https runs against the local hub server with a certificate
from a test CA (trustme), TLS end to end through the proxy's CONNECT tunnel."""

from __future__ import annotations

import base64
import ssl

import pytest
import trustme

from fleet.agent.cache import WeightCache
from fleet.sources import write_manifest
from fleet.agent.transfer import RetryPolicy
from fleet.agent.transports import FetchRefused, HttpTransfer
from tests.support.forward_proxy import ForwardProxy
from fleet.testing.hub_server import HubServer

FILES = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": bytes(range(256)) * 4000}


@pytest.fixture(autouse=True)
def _no_proxy_from_the_machine(monkeypatch):
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def _serve(hub: HubServer) -> str:
    d = hub.static_root / "m"
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    write_manifest(d, with_sha256=True)
    return f"{hub.url}/static/m/"


def _cache(tmp_path) -> WeightCache:
    return WeightCache(tmp_path / "cache", retry=RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0), reserve_bytes=0)


def _static(tmp_path):
    root = tmp_path / "static"
    root.mkdir()
    return root


def test_an_http_source_goes_through_http_proxy_in_absolute_form_with_its_credentials(tmp_path, monkeypatch):
    auth = "Basic " + base64.b64encode(b"fleet:p@ss").decode()
    with HubServer(static_root=_static(tmp_path)) as hub, ForwardProxy(require_auth=auth) as proxy:
        source = _serve(hub)
        monkeypatch.setenv("http_proxy", proxy.url.replace("http://", "http://fleet:p%40ss@"))
        path = _cache(tmp_path).ensure(source)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    targets = [target for method, target, got in proxy.log if method == "GET" and got == auth]
    assert f"{source}fleet-manifest.json" in targets                    # httpx, the manifest
    assert f"{source}model.safetensors" in targets                      # HttpTransfer, the file
    assert f"{source}config.json" in targets
    assert all(got == auth for _, _, got in proxy.log)


def test_an_https_source_tunnels_through_the_proxy_with_its_credentials(tmp_path, monkeypatch):
    # The origin's name resolves at the proxy only (an internal host): a client that went
    # around the proxy could not reach it.
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("models.fleet-test.invalid").configure_cert(server_context)
    auth = "Basic " + base64.b64encode(b"fleet:p@ss").decode()
    with HubServer(static_root=_static(tmp_path), tls=server_context) as hub, \
            ForwardProxy(require_auth=auth, hosts={"models.fleet-test.invalid": "127.0.0.1"}) as proxy:
        source = _serve(hub).replace("127.0.0.1", "models.fleet-test.invalid")
        assert source.startswith("https://")
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))            # trust the test CA, as a user would theirs
        monkeypatch.setenv("https_proxy", proxy.url.replace("http://", "http://fleet:p%40ss@"))
        path = _cache(tmp_path).ensure(source)
    assert (path / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    origin = source.split("/")[2]
    tunnels = [(target, got) for method, target, got in proxy.log if method == "CONNECT"]
    assert tunnels and all(target == origin and got == auth for target, got in tunnels), proxy.log
    assert not [entry for entry in proxy.log if entry[0] != "CONNECT"]   # nothing in the clear
    assert hub.log.file_gets("m/model.safetensors")


def test_no_proxy_bypasses_the_proxy(tmp_path, monkeypatch):
    with HubServer(static_root=_static(tmp_path)) as hub, ForwardProxy() as proxy:
        source = _serve(hub)
        monkeypatch.setenv("http_proxy", proxy.url)
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        _cache(tmp_path).ensure(source)
    assert proxy.log == []
    assert hub.log.file_gets("m/model.safetensors")


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_proxy_that_refuses_the_credentials_is_no_retry_and_names_the_url(scheme, monkeypatch):
    # http: the proxy answers the GET with 407; https: it refuses the CONNECT with 407, before any
    # TLS. Neither is a transient failure (TransferError would be retried with backoff).
    url = f"{scheme}://models.fleet-test.invalid/m/model.safetensors"
    with ForwardProxy(require_auth="Basic right") as proxy:
        monkeypatch.setenv(f"{scheme}_proxy", proxy.url.replace("http://", "http://fleet:wrong@"))
        with pytest.raises(FetchRefused, match=rf"^{url}: HTTP 407"):
            HttpTransfer().fetch(url, None, 0, {}, None)  # type: ignore[arg-type]
    assert [method for method, _, _ in proxy.log] == ["GET" if scheme == "http" else "CONNECT"]


def test_a_proxy_url_that_is_not_http_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("https_proxy", "socks5://127.0.0.1:1080")
    with pytest.raises(FetchRefused, match=r"https_proxy='socks5://127.0.0.1:1080': only an http:// proxy"):
        HttpTransfer().fetch("https://models.example/m/model.safetensors", None, 0, {}, None)  # type: ignore[arg-type]
