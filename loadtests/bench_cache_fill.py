"""Weight-cache fill from a local HTTP server, against curl fetching the same files in the same
run; the verification costs; and 8 processes asking for one model at once.

    PYTHONPATH=. python loadtests/bench_cache_fill.py [--size-mib 512] [--shards 4] [--repeats 3]

Serves a generated model (``--shards`` safetensors-sized files of random bytes plus small JSON
files, a fleet-manifest.json with sha256) from tests/hub_server.py (``sendfile``, HTTP/1.1
keep-alive) on 127.0.0.1, then, ``--repeats`` times in alternation:

The server (tests/hub_server.py) runs in a process of its own. Measured:

- curl, one process for all files, sequential (``-o`` per URL) and ``--parallel --parallel-max 4``;
- Fleet, ``WeightCache.ensure`` of the manifest into a fresh cache root, one file at a time and 4
  at once (the default): fetch + sha256 while writing + verification + rename into the store.

Prints the medians (MB/s, the CPU seconds each client spent per GB, and the ratio to curl at the
same parallelism), then the verification
costs: sha256 of the files alone (what hashing costs on this CPU), ``verify`` (a full re-hash of
the cached model), and ``lookup`` (the stat check every use makes). Last, 8 processes call
``ensure`` on one empty cache at the same moment and the server counts the GETs of each shard
(the goal: 1). Both clients write to the same file system (``--dir``, default a temp directory).
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
from fleet.agent.sources import write_manifest  # noqa: E402
REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    """tests/hub_server.py in a process of its own (in this one it would share the GIL with
    Fleet's client, and not with curl)."""

    def __init__(self, static_root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.hub_server", str(static_root)], cwd=REPO,
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


def run_curl(urls: list[str], out: Path, parallel: int) -> float:
    out.mkdir(parents=True)
    cmd = ["curl", "-s", "-f", "--http1.1"]
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
    ap.add_argument("--dir", type=Path, default=None, help="Work directory (default: a temp directory).")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-cache-", dir=args.dir))
    try:
        static = work / "static"
        total = make_model(static / "model", args.size_mib, args.shards)
        files = sorted(p.name for p in (static / "model").iterdir() if p.name != "fleet-manifest.json")
        print(f"model: {len(files)} files, {total / 1e6:.0f} MB; machine: {os.cpu_count()} CPU(s)")
        with ServerProcess(static) as server:
            source = f"{server.url}/static/model/"
            urls = [f"{server.url}/static/model/{n}" for n in files]
            times: dict[str, list[float]] = {k: [] for k in ("curl x1", "fleet x1", "curl x4", "fleet x4")}
            cpu: dict[str, list[float]] = {k: [] for k in times}
            for r in range(args.repeats):
                for name in times:
                    out = work / f"run-{r}-{name.replace(' ', '')}"
                    parallel = 4 if name.endswith("x4") else 1
                    os.sync()
                    who = resource.RUSAGE_CHILDREN if name.startswith("curl") else resource.RUSAGE_SELF
                    before = resource.getrusage(who)
                    t = run_curl(urls, out, parallel) if name.startswith("curl") else run_fleet(source, out, parallel)
                    after = resource.getrusage(who)
                    times[name].append(t)
                    cpu[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
                    shutil.rmtree(out)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\nfill throughput (median of {args.repeats}; MB = 1e6 bytes):")
            for k in times:
                print(f"  {k:9s} {total / med[k] / 1e6:8.0f} MB/s  ({med[k]:.2f} s; runs "
                      + ", ".join(f"{t:.2f}" for t in times[k])
                      + f"; CPU {statistics.median(cpu[k]) / total * 1e9:.2f} s per GB)")
            for p in ("x1", "x4"):
                print(f"  fleet/curl {p}: {med['curl ' + p] / med['fleet ' + p]:.2f}x")

            root = work / "verify"
            run_fleet(source, root, 4)
            cache = WeightCache(root, reserve_bytes=0)
            [entry] = cache.entries()
            t = time.perf_counter()
            for n in files:
                h = hashlib.sha256()
                with (static / "model" / n).open("rb") as f:
                    while chunk := f.read(4 << 20):
                        h.update(chunk)
            sha_s = time.perf_counter() - t
            t = time.perf_counter()
            assert cache.verify(entry.key) == []
            verify_s = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(100):
                assert cache.lookup(source) is not None
            lookup_ms = (time.perf_counter() - t) * 10
            print("\nverification:")
            print(f"  sha256 alone (this CPU, page cache): {total / sha_s / 1e6:.0f} MB/s")
            print(f"  fleet cache verify (full re-hash):   {verify_s:.2f} s")
            print(f"  lookup (stat check of {len(files)} files):   {lookup_ms:.2f} ms per use")

            n0 = len(server.requests())
            root = work / "concurrent"
            start_at = time.time() + 1.5
            with multiprocessing.get_context("spawn").Pool(8) as pool:
                paths = pool.map(_ensure_in_process, [(str(root), source, start_at)] * 8)
            gets = [p for m, p, _ in server.requests()[n0:] if m == "GET" and p.endswith(".safetensors")]
            per_shard = {n: sum(1 for p in gets if p.endswith(n)) for n in files if n.endswith(".safetensors")}
            print(f"\n8 processes asking for one model at once: {len(set(paths))} distinct path(s); "
                  f"GETs per shard: {sorted(set(per_shard.values()))} "
                  f"({'1 download' if set(per_shard.values()) == {1} else 'MORE THAN ONE DOWNLOAD'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
