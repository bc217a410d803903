"""fleet.enginesim.metrics against real vLLM 0.32's /metrics (tests/data/vllm-0.32-metrics.txt): the
simulator's series have vLLM's names, types, label names and bucket boundaries."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from fleet.enginesim.metrics import ReplicaMetrics
from fleet.enginesim.model import FinishedRequest

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32-metrics.txt"
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Families the simulator deliberately does not export (nothing to report; see fleet.enginesim.metrics),
# named as the text format writes them (counters with their _total).
NOT_SIMULATED = {
    "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
    "vllm:estimated_write_bytes_per_gpu_total", "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total", "vllm:mm_cache_queries_total", "vllm:mm_cache_hits_total",
    "vllm:prompt_tokens_cached_by_source_total", "vllm:admission_rejections_total", "vllm:cache_config_info",
}


def parse(text: str) -> dict[str, dict]:
    """family -> {"type", "labels": set of label-name tuples, "le": {sample name: bucket bounds}}."""
    fams: dict[str, dict] = defaultdict(lambda: {"type": None, "labels": set(), "le": defaultdict(list)})
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        name = m["name"]
        if name.endswith("_created"):
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        family = name
        for suffix in ("_bucket", "_count", "_sum"):
            if name not in types and name.endswith(suffix) and name[: -len(suffix)] in types:
                family = name[: -len(suffix)]
        fam = fams[family]
        fam["type"] = types[family]
        le = labels.pop("le", None)
        if le is not None:
            fam["le"][name].append(le)
        fam["labels"].add(tuple(sorted(labels)))
    return dict(fams)


def simulator_exposition() -> str:
    m = ReplicaMetrics("tiny-llama", max_model_len=1024, profile="cpu-tiny-llama")
    m.request_received(max_tokens=5)
    m.first_token(0.01)
    m.finished(FinishedRequest("r", "length", 13, 5, 0, 0, 0.0, 0.001, 0.01, 0.05), max_tokens=5)
    return m.exposition().decode()


def test_fixture_is_real_vllm_output():
    real = parse(FIXTURE.read_text())
    assert "vllm:time_to_first_token_seconds" in real and "vllm:num_requests_running" in real
    assert len(real) > 35


def test_simulated_families_have_vllms_names_types_and_label_names():
    real = {k: v for k, v in parse(FIXTURE.read_text()).items() if k.startswith("vllm:")}
    sim = {k: v for k, v in parse(simulator_exposition()).items() if k.startswith("vllm:")}
    assert set(sim) <= set(real), f"not in vLLM: {sorted(set(sim) - set(real))}"
    missing = set(real) - set(sim) - NOT_SIMULATED
    assert not missing, f"vLLM exports these and the simulator does not: {sorted(missing)}"
    for name, fam in sim.items():
        assert fam["type"] == real[name]["type"], name
        assert fam["labels"] == real[name]["labels"], name


def test_histograms_have_vllms_bucket_boundaries():
    real = parse(FIXTURE.read_text())
    sim = parse(simulator_exposition())
    for name, fam in sim.items():
        if fam["type"] != "histogram":
            continue
        assert fam["le"] == real[name]["le"], name


def test_help_texts_say_simulator():
    helps = [ln for ln in simulator_exposition().splitlines() if ln.startswith("# HELP vllm:")]
    assert helps and all(ln.endswith("(Fleet engine SIMULATOR)") for ln in helps)
