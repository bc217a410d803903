"""What `fleet validate` and `fleet plan --advise` say about a deployment's model and its shape.

Owns `model_check` (a loaded deployment -> what validate prints about its model: a local model
path that does not exist, the engine args the installed vLLM refuses (`fleet.engines.vllm_args`),
a ``--max-model-len`` above the model's maximum (`fleet.models.memory.MemoryNeed.max_len_problem`,
the rule placement applies in the controller), the TP size vLLM
accepts for it, and whether each ``spec.resources.gpuProduct`` / MIG profile holds the weights
(at the dtype vLLM loads them) and one ``max_model_len`` sequence per GPU, naming needed vs
available), `advice_table`
and `advice_json` (the shapes that fit, their concurrency, the cheapest for a target), and
`model_problems` (every deployment's `model_check` problems: what `fleet validate` and `fleet
apply` refuse). The work is `fleet.models`; the model is read by
`fleet.controller.model_memory.memory_need_or_reason` (the reading the controller and `fleet
up`'s preflight share); this module renders. Called by `fleet.cli.local` (validate),
`fleet.cli.rollout` (apply) and `fleet.cli.placement` (plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.table import Table

from fleet.controller.model_memory import memory_need_or_reason
from fleet.engines.vllm_args import check_engine_args
from fleet.models.advise import ShapeAdvice, cheapest, common_product, mig_memory_mib
from fleet.models.facts import GIB, tp_problem
from fleet.models.memory import MemoryNeed
from fleet.spec import LoadedDeployment


@dataclass
class ModelCheck:
    """What validate found: ``problems`` fail it (exit 2), ``notes`` are printed beside ``ok``."""

    need: MemoryNeed | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _products(ld: LoadedDeployment) -> tuple[str, ...]:
    """``spec.resources.gpuProduct`` as a tuple: a string, or an ordered list of products."""
    return ld.deployment.spec.resources.gpu_products


MIG_DEFAULT_PRODUCT = "NVIDIA H100 80GB HBM3"
"""The GPU a ``migProfile`` without ``gpuProduct`` is sized on: its instances' memory as NVML
reports it there (`fleet.inventory.mig`'s H100 80GB table: ``3g.40gb`` 40,448 MiB)."""


def _missing_path(ld: LoadedDeployment, paths_on_nodes: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) for a local ``spec.model.source`` that does not exist on this machine:
    a problem naming the field and the path, or with ``paths_on_nodes`` a note (the path is read
    on the nodes, as a Kubernetes hostPath)."""
    spec = ld.deployment.spec
    if spec.engine.kind == "sim":
        return [], []
    local = spec.model.local_path(ld.base_dir)
    if local is None or local.exists():
        return [], []
    if paths_on_nodes:
        return [], [f"model path {local} not on this machine: not checked (--paths-on-nodes)"]
    return [f"{ld.path}[{ld.index}] spec.model.source: {spec.model.source!r}: no such directory ({local}); "
            "give an existing path, or --paths-on-nodes when the path exists only on the GPU nodes"], []


def _devices(ld: LoadedDeployment, notes: list[str]) -> list[tuple[str, int]]:
    """The devices one replica may get: (name, memory MiB as NVML reports it) per listed product
    (its MIG instance with ``migProfile``); a ``migProfile`` without ``gpuProduct`` on
    `MIG_DEFAULT_PRODUCT`. Products Fleet has no memory for are noted in ``notes``."""
    r = ld.deployment.spec.resources
    devices: list[tuple[str, int]] = []
    for product in _products(ld):
        info = common_product(product)
        if info is None:
            notes.append(f"memory of {product!r} unknown (not in Fleet's product table): see fleet plan --advise "
                         "--inventory")
            continue
        mib = mig_memory_mib(product, info.memory_mib, r.mig_profile) if r.mig_profile else info.memory_mib
        if mib is not None:
            devices.append((f"MIG {r.mig_profile} of {product}" if r.mig_profile else product, mib))
    if r.mig_profile and not devices and not _products(ld):
        h100 = common_product(MIG_DEFAULT_PRODUCT)
        mib = mig_memory_mib(MIG_DEFAULT_PRODUCT, h100.memory_mib, r.mig_profile) if h100 else None
        if mib is not None:
            devices.append((f"MIG {r.mig_profile} (sized as on an H100 80GB)", mib))
    return devices


def _engine_problems(ld: LoadedDeployment, need: MemoryNeed | None, out: ModelCheck, vllm_check: bool) -> None:
    """The engine's flags through the installed vLLM's parser (`fleet.engines.vllm_args`) and
    ``--max-model-len`` against the model's maximum (`fleet.models.memory.MemoryNeed.max_len_problem`),
    into ``out``."""
    spec = ld.deployment.spec
    where = f"{ld.path}[{ld.index}] spec.engine.args"
    if spec.engine.kind == "vllm":
        checked = check_engine_args(spec.engine.args, vllm_check)
        out.problems.extend(f"{where}: {p}" for p in checked.problems)
        out.notes.extend(checked.notes)
    if need is not None and (problem := need.max_len_problem) is not None:
        out.problems.append(f"{where}: {problem}")


def model_check(ld: LoadedDeployment, paths_on_nodes: bool = False, vllm_check: bool = True) -> ModelCheck:
    """The model's checks for ``fleet validate`` (module docstring). A local model path that does
    not exist fails (unless ``paths_on_nodes``: `_missing_path`); the engine args the installed
    vLLM refuses fail, naming the flag (`_engine_problems`; not asked without ``vllm_check``); a
    model that cannot be read otherwise (remote and offline, no config.json) is a note, not a
    failure: `fleet up` checks the weights."""
    where = f"{ld.path}[{ld.index}] spec"
    problems, notes = _missing_path(ld, paths_on_nodes)
    if problems or notes:
        out = ModelCheck(problems=problems, notes=notes)
        _engine_problems(ld, None, out, vllm_check)
        return out
    need, why = memory_need_or_reason(ld)
    out = ModelCheck(need)
    _engine_problems(ld, need, out, vllm_check)
    if need is None:
        out.notes.extend([f"model not checked: {why}"] if why else [])
        return out
    r = ld.deployment.spec.resources
    f = need.facts
    if r.accelerator == "cpu":   # its length checked (`_engine_problems`); host memory is not
        out.notes.append(f"model {f.architecture}, {f.weight_bytes / GIB:.1f} GiB of weights ({f.weight_source}); "
                         f"CPU replica: up to {need.context_tokens:,} tokens per sequence, host memory not checked")
        return out
    if (problem := tp_problem(f, r.tensor_parallel_size)) is not None:
        out.problems.append(f"{where}.resources.tensorParallelSize: {problem}")
        return out
    devices = _devices(ld, out.notes)
    context = f"{need.context_tokens:,}-token"
    fitting, misfits = [], []
    for name, mib in devices:
        problem = need.fits(mib)
        if problem is None:
            fitting.append(f"fits {name}: {need.concurrency(mib):.1f} {context} sequences at once")
        else:
            misfits.append(f"does not fit {name} ({mib} MiB): {problem}")
    if devices and not fitting:   # no listed product holds it: refuse
        field_name = "migProfile" if r.mig_profile else "tensorParallelSize"
        out.problems.extend(f"{where}.resources.{field_name}: model {f.architecture} {m}" for m in misfits)
        return out
    quant = (f", loaded as {need.settings.quantization} ({need.loaded_weight_bytes / GIB:.1f} GiB)"
             if need.loaded_weight_bytes != f.weight_bytes else "")
    out.notes.extend([f"model {f.architecture}, {f.weight_bytes / GIB:.1f} GiB of weights ({f.weight_source}){quant}, "
                      f"{need.kv_bytes_per_token / 1024:.0f} KiB of KV cache per token per GPU at "
                      f"TP={need.tensor_parallel_size}", *fitting, *misfits])
    return out


def model_problems(loaded: list[LoadedDeployment], paths_on_nodes: bool = False,
                   vllm_check: bool = True) -> tuple[list[ModelCheck], list[str]]:
    """`model_check` of each deployment, and all their problems in order (empty: every model
    check passed)."""
    checks = [model_check(ld, paths_on_nodes, vllm_check) for ld in loaded]
    return checks, [p for c in checks for p in c.problems]


def advice_table(title: str, rows: list[ShapeAdvice], need: MemoryNeed, target: float,
                 show_all: bool = False) -> Table:
    """One row per shape that fits (every shape with ``show_all``): product, shape, GPUs, device
    memory, KV cache per GPU, concurrency at the model's context, replicas (and GPUs or cost)
    for ``target``, the verdict; the cheapest marked."""
    best = cheapest(rows, target)
    priced = any(r.price_per_hour for r in rows)
    table = Table(title=title, title_justify="left")
    for col in ("product", "shape", "GPUs", "device memory", "KV cache / GPU",
                f"sequences of {need.context_tokens:,} tokens", f"replicas for {target:g}",
                "cost / h" if priced else "GPUs total", "verdict"):
        table.add_column(col, overflow="fold")
    for r in rows:
        if not r.fits and not show_all:
            continue
        mark = " [bold green]<- cheapest[/]" if r is best else ""
        replicas = r.replicas_for(target) if r.fits and r.concurrency >= 1 else 0
        cost = r.cost_for(target) if replicas else 0.0
        table.add_row(r.product, r.label, f"{r.gpus:.2g}", f"{r.device_memory_mib / 1024:.1f} GiB",
                      f"{max(0, r.kv_cache_bytes) / GIB:.1f} GiB", f"{r.concurrency:.1f}" if r.fits else "-",
                      str(replicas) if replicas else "-", (f"{cost:.2f}" if r.price_per_hour else "-" if priced else f"{cost:g}") if replicas else "-",
                      r.verdict + mark)
    return table


def advice_json(ld: LoadedDeployment, rows: list[ShapeAdvice], need: MemoryNeed, target: float) -> dict:
    best = cheapest(rows, target)
    f = need.facts
    return {
        "deployment": ld.deployment.name,
        "model": {"architecture": f.architecture, "weightBytes": f.weight_bytes, "weightSource": f.weight_source,
                  "parameters": f.parameters, "layers": f.layers, "attentionHeads": f.attention_heads,
                  "kvHeads": f.kv_heads, "headSize": f.head_size, "mla": f.mla},
        "contextTokens": need.context_tokens,
        "targetConcurrency": target,
        "shapes": [{"product": r.product, "tensorParallelSize": r.tensor_parallel_size, "migProfile": r.mig_profile,
                    "deviceMemoryMiB": r.device_memory_mib, "gpus": r.gpus, "fits": r.fits, "problem": r.problem,
                    "concurrency": round(r.concurrency, 2), "kvCacheBytesPerGpu": r.kv_cache_bytes,
                    "replicasForTarget": r.replicas_for(target) if r.fits else None,
                    "cheapest": r is best} for r in rows],
    }
