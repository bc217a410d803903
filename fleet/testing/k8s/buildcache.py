"""What the two REAL Kubernetes layers of the tests share: a build done once into a cache
directory, under a file lock and a time budget, its failure remembered; the steps it runs; and the
small helpers their processes need (a free loopback port, an HTTP readiness probe, this machine's
Debian mirror).

Owns `Unavailable` and `OutOfTime` (why a layer cannot be had here, in one line), `build_once`,
`raise_recent_failure`, `build_command` (the ``python -m ... build`` both layers answer),
`run_step`, `run_group`, `debian_mirror`, `free_port` and `http_ok`. Used by
fleet/testing/k8s/apiext.py (the apiextensions-apiserver 0.36 over etcd) and
fleet/testing/k8s/kube.py (Kubernetes 1.20.2's control plane); each keeps what differs: its
source, its steps and its processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
"""The key apt checks Debian's archive with (``Signed-By`` of the sources both builds add)."""

FAILURE_TTL_S = 6 * 3600.0
"""How long a failed build is remembered: a second run in that time skips at once, saying why,
instead of paying for the same failure again."""

LOCK_POLL_S = 1.0
"""How often a build waiting for another build's lock on the same cache tries again."""

T = TypeVar("T")


class Unavailable(Exception):
    """A real layer cannot be built or run here; ``str(err)`` says why, in one line (the step that
    failed and the tail of its output)."""


class OutOfTime(Unavailable):
    """A build's time budget ran out. Not remembered as a failure: the compiler's cache keeps what
    was compiled, so the next build goes on from there."""


def build_once(cache: Path, timeout_s: float, *, found: Callable[[Path], T | None],
               make: Callable[[Path, float], T], retry_env: str,
               scratch: Callable[[Path], Iterable[Path]] = lambda cache: ()) -> T:  # fmt: skip
    """What ``found(cache)`` returns, else what ``make(cache, deadline)`` builds, at most once at a
    time per ``cache`` (an exclusive lock on ``cache/.lock``; a second caller waits for it, then
    takes the first one's result). ``deadline`` is `time.monotonic()` + ``timeout_s``.

    A failure of ``make`` (`Unavailable`, not `OutOfTime`) is written to
    ``cache/unavailable.json`` and raised again by every call for `FAILURE_TTL_S` unless the
    environment variable ``retry_env`` is ``1``. Whatever ``scratch(cache)`` lists (unpacked
    sources) is removed after ``make``, whether it succeeded or not.
    Raises `Unavailable` (the remembered failure, the lock held past ``timeout_s``, ``make``'s own)."""
    if (result := found(cache)) is not None:
        return result
    raise_recent_failure(cache, retry_env)
    cache.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(cache / ".lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"another build of {cache} held its lock for {timeout_s:.0f} s") from None
                time.sleep(LOCK_POLL_S)
        if (result := found(cache)) is not None:   # built while we waited
            return result
        raise_recent_failure(cache, retry_env)
        try:
            return make(cache, deadline)
        except OutOfTime:
            raise
        except Unavailable as err:
            (cache / "unavailable.json").write_text(json.dumps({"reason": str(err), "at_s": time.time()}))
            raise
        finally:
            for tree in scratch(cache):
                shutil.rmtree(tree, ignore_errors=True)


def build_command(argv: list[str] | None, *, prog: str, layer: str, build: Callable[[float], T],
                  timeout_s: float, describe: Callable[[T], str], info: Callable[[T], dict]) -> int:  # fmt: skip
    """``python -m PROG build [--timeout-s S] [--strict]``: ``build(timeout_s)`` (or find) a layer
    and print, as the last line, where it is (``describe(binaries)``, then how long its build took
    and how long finding it took, from ``info(binaries)``'s ``build_s`` and ``steps_s``) or why it
    cannot be had (``LAYER: unavailable (N s): reason``). tests/run.sh reads that line. Exit 0
    either way: a missing layer is a skip, not a failure (``--strict``: exit 1 then)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--timeout-s", type=float, default=timeout_s)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the binaries cannot be had")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        binaries = build(args.timeout_s)
    except Unavailable as err:
        print(f"{layer}: unavailable ({time.monotonic() - started:.0f} s): {err}")
        return 1 if args.strict else 0
    facts = info(binaries)
    print(f"{describe(binaries)} (built in {facts.get('build_s')} s {facts.get('steps_s')}; "
          f"found in {time.monotonic() - started:.1f} s)")
    return 0


def raise_recent_failure(cache: Path, retry_env: str) -> None:
    """Raise the failure `build_once` remembered in ``cache`` if it is younger than
    `FAILURE_TTL_S` and ``retry_env`` is not ``1`` in the environment."""
    marker = cache / "unavailable.json"
    if not marker.exists() or os.environ.get(retry_env) == "1":
        return
    failure = json.loads(marker.read_text())
    age_s = time.time() - failure["at_s"]
    if age_s < FAILURE_TTL_S:
        raise Unavailable(f"{failure['reason']} (a build {age_s / 60:.0f} min ago; {retry_env}=1 tries again)")


def run_step(step: str, cmd: list[str], deadline: float, **kw) -> str:
    """Run ``cmd`` (`run_group`) under what is left before ``deadline`` (`time.monotonic()`); its
    stdout. Raises `Unavailable` naming ``step`` on a non-zero exit (with the tail of its output)
    or a missing program, `OutOfTime` when the time runs out."""
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        raise OutOfTime(f"{step}: no time left of the build's budget")
    try:
        proc = run_group(cmd, left_s, **kw)
    except subprocess.TimeoutExpired:
        raise OutOfTime(f"{step}: the build's time budget ran out during this step") from None
    except FileNotFoundError as err:
        raise Unavailable(f"{step}: {err.filename} not found") from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise Unavailable(f"{step}: exit {proc.returncode}: {tail}")
    return proc.stdout


def run_group(cmd: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    """`subprocess.run` in a process group of its own, all of it killed on time-out (``go build``
    and ``dpkg-deb`` leave children that would go on writing). Raises TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, **kw)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (its deb822 ``.sources`` or ``sources.list``,
    security suites left out). Raises `Unavailable` when there is none."""
    texts = [p.read_text(errors="replace") for p in sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))]
    for text in texts:
        for stanza in text.split("\n\n"):
            if "debian-archive-keyring" in stanza and not re.search(r"^Suites:.*-security", stanza, re.M):
                if m := re.search(r"^URIs:\s*(\S+)", stanza, re.M):
                    return m.group(1)
    sources_list = Path("/etc/apt/sources.list")
    if sources_list.exists():
        for line in sources_list.read_text(errors="replace").splitlines():
            m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
            if m and "security" not in m.group(2):
                return m.group(1)
    raise Unavailable("no Debian mirror in /etc/apt sources (this is not a Debian machine?)")


def terminate(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """Stop one process of a real layer: SIGTERM, then SIGKILL after ``grace_s`` seconds; nothing
    for None or a process that has exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, ca_file: Path | None = None, token: str | None = None) -> bool:
    """Whether ``GET url`` answers 200 within 2 s (TLS checked against ``ca_file`` when given; a
    bearer ``token`` when given); False on any connection or protocol error."""
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False
