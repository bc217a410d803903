"""Weight-cache fill from a local HTTP server, against curl fetching the same files in the same
run; what verification costs; and 8 processes asking for one model at once.

    PYTHONPATH=. python loadtests/bench_cache_fill.py [--size-mib 512] [--shards 4] [--repeats 3] [--hub]

Serves a generated model (``--shards`` safetensors-sized files of random bytes plus small JSON
files, a fleet-manifest.json with sha256) from fleet/testing/hub_server.py (``sendfile``, HTTP/1.1
keep-alive) in a process of its own on 127.0.0.1. Then, ``--repeats`` times, each client once,
in alternating order (reversed every other repeat, so that neither client always runs after the
other); before every run the previous outputs are deleted, ``sync`` is called and the machine is
left ``--settle-s`` alone:

- ``curl x1`` / ``curl x4``: one curl process for all files, sequential (``-o`` per URL) and
  ``--parallel --parallel-max 4``, then ``sync`` of its files (durable, as Fleet's are);
- ``fleet x1`` / ``fleet x4``: ``WeightCache.ensure`` of the manifest into a fresh cache root, one
  file at a time and 4 at once (the default): fetch + sha256 + verification + fsync + rename
  into the store;
- ``fleet x1 no-sha256``: Fleet's transport alone (`HttpTransfer` into the same pooled buffers,
  each file fsynced), without hashing: the difference to ``fleet x1`` is what verification costs.

Prints the medians (MB/s; the user and system CPU seconds each client spent per GB, less
sensitive to other jobs than wall time; the ratio to curl at the same parallelism), then the
verification costs: sha256 alone (what hashing costs on this CPU), ``verify`` (a full re-hash of
the cached model) and ``lookup`` (the stat check every use makes). Last, 8 processes call
``ensure`` on one empty cache at the same moment and the server counts the GETs of each file (the
goal: 1). Both clients write to the same file system (``--dir``, default a temp directory).
With ``--hub``, the same model is then served as the hub repository org/bench and filled from
``hf://org/bench`` (huggingface_hub's download code) against curl -L of the same resolve URLs.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.agent.cache import WeightCache  # noqa: E402
from fleet.sources import write_manifest  # noqa: E402
from fleet.agent.transfer import (  # noqa: E402
    CHUNK_BYTES, WRITE_BYTES, WRITEBACK_BYTES, start_writeback,
)
from fleet.agent.transports import HttpTransfer  # noqa: E402
REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """fleet/testing/hub_server.py in a process of its own (in this one it would share the GIL with
    Fleet's client, and not with curl)."""

    def __init__(self, *server_args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "fleet.testing.hub_server", *server_args], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.proc.kill()
            raise RuntimeError("the hub server did not start")

    def requests(self) -> list:
        import httpx

        return httpx.get(f"{self.url}/_log").json()["requests"]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def make_model(d: Path, size_mib: int, shards: int) -> int:
    d.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    per = size_mib // shards
    for i in range(shards):
        with (d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors").open("wb") as f:
            for j in range(per):
                f.write(hashlib.sha256(block + j.to_bytes(4, "big") + i.to_bytes(4, "big")).digest() + block[32:])
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "tokenizer.json").write_bytes(os.urandom(2_000_000))
    write_manifest(d)
    os.sync()   # the model's dirty pages written back: the first timed run does not pay for them
    return sum(p.stat().st_size for p in d.iterdir() if p.name != "fleet-manifest.json")


def run_curl(urls: list[str], out: Path, parallel: int, follow: bool = False) -> float:
    out.mkdir(parents=True)
    cmd = ["curl", "-s", "-f", "--http1.1"] + (["-L"] if follow else [])
    if parallel > 1:
        cmd += ["--parallel", "--parallel-max", str(parallel)]
    for i, u in enumerate(urls):
        cmd += ["-o", str(out / f"f{i}"), u]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    # Durable, as Fleet's files are before their rename; in a child process, so that the CPU the
    # kernel spends writing them back is counted on curl's side (RUSAGE_CHILDREN), as on Fleet's.
    subprocess.run(["sync", *(str(f) for f in out.iterdir())], check=True)
    return time.perf_counter() - t


def run_fleet(source: str, root: Path, parallel: int) -> float:
    cache = WeightCache(root, parallel_files=parallel, reserve_bytes=0)
    t = time.perf_counter()
    cache.ensure(source)
    return time.perf_counter() - t


class _PlainWriter:
    """The file object Fleet's transport writes to, without the hashing: ``fill`` reads into one
    ``CHUNK_BYTES`` buffer and writes it in ``WRITE_BYTES`` pieces, starting writeback every
    ``WRITEBACK_BYTES`` (`fleet.agent.transfer._HashingWriter` less sha256)."""

    def __init__(self, f) -> None:
        self.f = f
        self.buf = bytearray(CHUNK_BYTES)
        self.clean_to = 0

    def fill(self, readinto) -> int:
        n = readinto(memoryview(self.buf))
        for off in range(0, n, WRITE_BYTES):
            self.f.write(memoryview(self.buf)[off:min(n, off + WRITE_BYTES)])
        if (end := self.f.tell()) - self.clean_to >= WRITEBACK_BYTES:
            self.f.flush()
            start_writeback(self.f.fileno(), self.clean_to, end - self.clean_to)
            self.clean_to = end
        return n

    def write(self, chunk: bytes) -> int:
        return self.f.write(chunk)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self.f.truncate(size)

    def flush(self) -> None:
        self.f.flush()


def run_transport_only(urls: list[str], out: Path) -> float:
    """Fleet's `HttpTransfer` without hashing: each file fetched in turn, all fsynced at the end."""
    out.mkdir(parents=True)
    transfer = HttpTransfer()
    t = time.perf_counter()
    paths = []
    for i, u in enumerate(urls):
        paths.append(out / f"f{i}")
        with paths[-1].open("w+b") as f:
            transfer.fetch(u, _PlainWriter(f), 0, {}, None)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t


def run_hub(files: list[str], model_dir: Path, out: Path, repeats: int, settle_s: float) -> None:
    """``hf://`` sources: fleet/testing/hub_server.py serving ``model_dir`` as the hub repository
    org/bench (from memory, not sendfile), curl -L fetching each file's resolve URL against Fleet's
    ``ensure("hf://org/bench")`` (huggingface_hub's ``http_get``), one file at a time."""
    times: dict[str, list[float]] = {"curl x1 hf": [], "fleet x1 hf": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    total = sum((model_dir / n).stat().st_size for n in files)
    with ServerProcess("--repo", f"org/bench={model_dir}") as server:
        before_env = os.environ.get("HF_ENDPOINT")
        os.environ["HF_ENDPOINT"] = server.url
        try:
            for r in range(repeats):
                for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
                    dest = out / f"hub-{r}-{name.split()[0]}"
                    os.sync()
                    time.sleep(settle_s)
                    who = resource.RUSAGE_CHILDREN if name.startswith("curl") else resource.RUSAGE_SELF
                    before = _cpu_s(who)
                    if name.startswith("curl"):
                        urls = [f"{server.url}/org/bench/resolve/main/{n}" for n in files]
                        t = run_curl(urls, dest, 1, follow=True)
                    else:
                        t = run_fleet("hf://org/bench", dest, 1)
                    after = _cpu_s(who)
                    times[name].append(t)
                    cpu[name].append(sum(after) - sum(before))
                    shutil.rmtree(dest)
        finally:
            if before_env is None:
                os.environ.pop("HF_ENDPOINT", None)
            else:
                os.environ["HF_ENDPOINT"] = before_env
    print(f"\nhf:// source (median of {repeats}; the stand-in hub sends from memory):")
    for k in times:
        print(f"  {k:18s} {total / statistics.median(times[k]) / 1e6:6.0f} MB/s  CPU "
              f"{statistics.median(cpu[k]) / total * 1e9:.2f} s/GB  (runs "
              + ", ".join(f"{t:.2f}" for t in times[k]) + " s)")
    print(f"  fleet/curl x1 hf: {statistics.median(times['curl x1 hf']) / statistics.median(times['fleet x1 hf']):.2f}x")


def _cpu_s(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def _ensure_in_process(args: tuple[str, str, float]) -> str:
    root, source, start_at = args
    while time.time() < start_at:
        time.sleep(0.001)
    return str(WeightCache(Path(root), reserve_bytes=0).ensure(source))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=1.0,
                    help="Pause after each sync, before each run (the same for every client).")
    ap.add_argument("--verbose", action="store_true", help="Print every run as it ends.")
    ap.add_argument("--hub", action="store_true",
                    help="Also fill from an hf:// source (the stand-in hub) against curl of the same URLs.")
    ap.add_argument("--dir", type=Path, default=None, help="Work directory (default: a temp directory).")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-cache-", dir=args.dir))
    try:
        static = work / "static"
        total = make_model(static / "model", args.size_mib, args.shards)
        files = sorted(p.name for p in (static / "model").iterdir() if p.name != "fleet-manifest.json")
        print(f"model: {len(files)} files, {total / 1e6:.0f} MB; machine: {os.cpu_count()} CPU(s), "
              f"load average {os.getloadavg()[0]:.2f} at the start")
        with ServerProcess(str(static)) as server:
            source = f"{server.url}/static/model/"
            urls = [f"{server.url}/static/model/{n}" for n in files]
            clients = ("curl x1", "fleet x1", "fleet x1 no-sha256", "curl x4", "fleet x4")
            times: dict[str, list[float]] = {k: [] for k in clients}
            cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
            for r in range(args.repeats):
                for name in (clients if r % 2 == 0 else clients[::-1]):
                    out = work / f"run-{r}-{name.replace(' ', '')}"
                    parallel = 4 if name.endswith("x4") else 1
                    os.sync()
                    time.sleep(args.settle_s)
                    who = resource.RUSAGE_CHILDREN if name.startswith("curl") else resource.RUSAGE_SELF
                    before = _cpu_s(who)
                    if name.startswith("curl"):
                        t = run_curl(urls, out, parallel)
                    elif name.endswith("no-sha256"):
                        t = run_transport_only(urls, out)
                    else:
                        t = run_fleet(source, out, parallel)
                    after = _cpu_s(who)
                    times[name].append(t)
                    cpu[name].append((after[0] - before[0], after[1] - before[1]))
                    shutil.rmtree(out)
                    if args.verbose:
                        print(f"  repeat {r} {name:18s} {t:.2f} s, CPU {cpu[name][-1][0]:.2f} user + "
                              f"{cpu[name][-1][1]:.2f} system s, load average {os.getloadavg()[0]:.2f}", flush=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\nfill throughput (median of {args.repeats}; MB = 1e6 bytes; CPU = user + system "
                  f"seconds per GB; load average {os.getloadavg()[0]:.2f} at the end):")
            for k in clients:
                user = statistics.median(u for u, _ in cpu[k]) / total * 1e9
                system = statistics.median(s for _, s in cpu[k]) / total * 1e9
                print(f"  {k:18s} {total / med[k] / 1e6:6.0f} MB/s  CPU {user:.2f} + {system:.2f} s/GB  (runs "
                      + ", ".join(f"{t:.2f}" for t in times[k]) + " s)")
            for p in ("x1", "x4"):
                paired = statistics.median(c / f for c, f in zip(times["curl " + p], times["fleet " + p]))
                print(f"  fleet/curl {p}: {med['curl ' + p] / med['fleet ' + p]:.2f}x "
                      f"(median of the per-repeat ratios: {paired:.2f}x)")
            fleet_cpu = statistics.median(u + s for u, s in cpu["fleet x1"]) / total * 1e9
            bare_cpu = statistics.median(u + s for u, s in cpu["fleet x1 no-sha256"]) / total * 1e9

            root = work / "verify"
            run_fleet(source, root, 4)
            cache = WeightCache(root, reserve_bytes=0)
            [entry] = cache.entries()
            t = time.perf_counter()
            cpu0 = time.thread_time()
            for n in files:
                h = hashlib.sha256()
                with (static / "model" / n).open("rb") as f:
                    while chunk := f.read(4 << 20):
                        h.update(chunk)
            sha_s = time.perf_counter() - t
            sha_cpu = (time.thread_time() - cpu0) / total * 1e9
            t = time.perf_counter()
            assert cache.verify(entry.key) == []
            verify_s = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(100):
                assert cache.lookup(source) is not None
            lookup_ms = (time.perf_counter() - t) * 10
            print("\nverification:")
            print(f"  sha256 alone (this CPU, page cache): {total / sha_s / 1e6:.0f} MB/s, {sha_cpu:.2f} CPU-s/GB")
            print(f"  fleet x1 fill: {fleet_cpu:.2f} CPU-s/GB with sha256, {bare_cpu:.2f} without "
                  f"(verification: {fleet_cpu - bare_cpu:.2f} CPU-s/GB)")
            print(f"  fleet cache verify (full re-hash):   {verify_s:.2f} s")
            print(f"  lookup (stat check of {len(files)} files):   {lookup_ms:.2f} ms per use")

            n0 = len(server.requests())
            root = work / "concurrent"
            start_at = time.time() + 1.5
            with multiprocessing.get_context("spawn").Pool(8) as pool:
                paths = pool.map(_ensure_in_process, [(str(root), source, start_at)] * 8)
            gets = [p for m, p, _ in server.requests()[n0:] if m == "GET" and p.rsplit("/", 1)[-1] in files]
            per_file = {n: sum(1 for p in gets if p.endswith("/" + n)) for n in files}
            print(f"\n8 processes asking for one model at once: {len(set(paths))} distinct path(s); "
                  f"the server saw {len(gets)} GETs of model files for {len(files)} files, "
                  f"{sorted(set(per_file.values()))} per file "
                  f"({'1 download' if set(per_file.values()) == {1} else 'MORE THAN ONE DOWNLOAD'})")
        if args.hub:
            run_hub(files, static / "model", work, args.repeats, args.settle_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
