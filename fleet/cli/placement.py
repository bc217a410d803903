"""`fleet plan` and `fleet inventory`: where replicas would run, and what the nodes offer.

Owns the two commands' arguments, help and output (tables, JSON, YAML); the work is done by
`fleet.placement` (strategies, explanations, MIG advice) and `fleet.inventory` (the inventory
file, NVML discovery). Registered on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from fleet.cli.common import Files, console, err_console, fail_with, load_or_exit

app = typer.Typer()


def _load_inventory(path: Path):
    from fleet.inventory.file import InventoryError, load_inventory

    try:
        return load_inventory(path)
    except InventoryError as err:
        raise fail_with("Invalid inventory", err.problems) from None


@app.command()
def plan(
    files: Files,
    inventory: Annotated[Optional[Path], typer.Option(
        "--inventory", "-i", help="Inventory YAML (kind: Inventory): the nodes to place on. See examples/inventories/. "
        "Required unless --advise.")] = None,
    replicas: Annotated[Optional[int], typer.Option(
        min=0, help="Replicas to place per deployment. Default: spec.replicas.initial (or min).")] = None,
    strategy: Annotated[str, typer.Option(help="Placement strategy: fleet (default) or first-fit.")] = "fleet",
    all_or_nothing: Annotated[bool, typer.Option(
        "--all-or-nothing", help="Place none of a deployment's replicas unless all fit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON.")] = False,
    advise: Annotated[bool, typer.Option(
        "--advise", help="List the shapes that can hold each deployment's model (TP 1/2/4/8 of each GPU product of "
        "--inventory, or of Fleet's table of common products; each MIG profile), the full-context sequences each "
        "holds at once, and the cheapest that reaches --target-concurrency. Places nothing.")] = False,
    target_concurrency: Annotated[float, typer.Option(
        min=1, help="With --advise: full-context sequences the deployment must hold at once, over all replicas.")] = 1,
    price: Annotated[Optional[list[str]], typer.Option(
        help="With --advise: PRODUCT=PRICE, a GPU's price per hour (repeat per product); cheapest is then by "
        "price, else by GPUs.")] = None,
    all_shapes: Annotated[bool, typer.Option(
        "--all-shapes", help="With --advise: list the shapes that do not fit too, with the reason.")] = False,
) -> None:
    """Show where each deployment's replicas would run on a declared cluster, and why not.

    Deployments are placed one after another on the same inventory, in file order as the
    controller places replicas created together: devices the inventory marks inUse, and those
    taken by earlier deployments, are not free. Each deployment's replicas are placed in one
    decision (one GPU product for all of them). Then each deployment left below
    spec.replicas.min, highest spec.priority first, preempts replicas of lower-priority
    deployments as the controller would (the same policy): the plan names each replica it would
    preempt and why, and where the preempted deployment's replacements go (or why they wait).
    Deployments are listed highest priority first. When gpuProduct lists several products and
    the plan uses a later one, it says why each earlier one was passed over. For each replica: the node (several
    for a gang), the NVLink domain or MIG parent GPU, the devices as CUDA_VISIBLE_DEVICES gets
    them (GPU or MIG UUIDs), and whether the node is warm (engine image and weights in its
    cache list). Nodes whose NVIDIA driver cannot run the engine's CUDA (engine.cudaVersion or
    the image's) are skipped, with the reason. When replicas do not fit: the reasons grouped by
    node class, and for MIG profiles, repartition advice with the nvidia-smi commands. Nothing is
    started. When the model can be read (config.json of a local, cached or hf:// source),
    products and MIG profiles whose memory cannot hold it are skipped, with the numbers.

    With --advise: the shape table instead (see --advise); exit code 0 when some shape fits each
    deployment, 1 when none does.

    Exit code 0 when every replica fits, 1 when some do not, 2 on invalid input.
    """
    from fleet.controller.model_memory import memory_need_or_reason
    from fleet.placement import PlacementRequest, get_strategy
    from fleet.placement.cpu import cpu_sharing_notes
    from fleet.placement.fleet_plan import PlanItem, plan_fleet

    loaded = load_or_exit(files)
    if advise:
        _advise(loaded, inventory, target_concurrency, price or [], as_json, all_shapes)
    if inventory is None:
        err_console.print("Give --inventory (or --advise).")
        raise typer.Exit(2)
    inv = _load_inventory(inventory)
    try:
        placer = get_strategy(strategy)
    except KeyError as err:
        err_console.print(str(err.args[0]))
        raise typer.Exit(2) from None
    items, by_name = [], {}
    for ld in loaded:
        spec = ld.deployment.spec
        count = spec.replicas.desired_at_start if replicas is None else replicas
        need, _ = memory_need_or_reason(ld)
        request = PlacementRequest.for_deployment(ld.deployment, count, all_or_nothing=all_or_nothing, memory=need)
        items.append(PlanItem(ld.deployment.name, request, spec.priority, spec.preemptible, spec.replicas.min))
        by_name[ld.deployment.name] = ld
    plans = [(by_name[p.item.name], p) for p in plan_fleet(items, inv.inventory, Counter(inv.in_use), placer)]
    if as_json:
        console.print_json(json.dumps([_plan_json(ld, p, inv.inventory) for ld, p in plans]))
    else:
        for ld, p in plans:
            _print_plan(ld, p, inv.inventory)
        for note in cpu_sharing_notes(r for _, p in plans for r in p.plan.placements):
            console.print(note, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(0 if all(p.plan.complete for _, p in plans) else 1)


def _advise(loaded, inventory: Path | None, target: float, prices: list[str], as_json: bool,
            all_shapes: bool) -> None:
    """`fleet plan --advise`: print each deployment's shape table; exits (0 when a shape fits each)."""
    from fleet.cli.models import advice_json, advice_table
    from fleet.controller.model_memory import memory_need_or_reason
    from fleet.models.advise import COMMON_GPU_PRODUCTS, advise, cheapest, products_of

    by_product: dict[str, float] = {}
    for item in prices:
        name, eq, value = item.rpartition("=")
        try:
            by_product[name] = float(value)
        except ValueError:
            name = ""
        if not eq or not name:
            err_console.print(f"--price {item!r}: expected PRODUCT=PRICE (a GPU's price per hour)", highlight=False)
            raise typer.Exit(2)
    products = products_of(_load_inventory(inventory).inventory) if inventory else COMMON_GPU_PRODUCTS
    docs, ok = [], True
    for ld in loaded:
        need, why = memory_need_or_reason(ld)
        if need is None or (why := need.max_len_problem) is not None:   # no shape holds a length vLLM refuses
            err_console.print(f"{ld.deployment.name}: no advice: {why or 'the model is simulated or not read'}",
                              highlight=False, markup=False)
            ok = False
            continue
        rows = advise(need, products, by_product)
        ok = ok and cheapest(rows, target) is not None
        if as_json:
            docs.append(advice_json(ld, rows, need, target))
            continue
        f = need.facts
        title = (f"{ld.deployment.name}: {f.architecture}, {f.weight_bytes / 2**30:.1f} GiB of weights "
                 f"({f.weight_source}), context {need.context_tokens:,} tokens, gpu_memory_utilization "
                 f"{need.settings.gpu_memory_utilization:g}")
        console.print(advice_table(title, rows, need, target, all_shapes))
        left_out = sum(1 for r in rows if not r.fits)
        if left_out and not all_shapes:
            console.print(f"  {left_out} other shape(s) do not fit (--all-shapes lists them)", highlight=False)
        best = cheapest(rows, target)
        console.print(f"  cheapest for {target:g} concurrent sequence(s): "
                      + (f"{best.label} of {best.product} x {best.replicas_for(target)} replica(s)" if best
                         else "none fits"), highlight=False, markup=False)
    if as_json:
        console.print_json(json.dumps(docs))
    raise typer.Exit(0 if ok else 1)


def _victims_json(victims) -> list[dict]:
    return [{"replica": v.replica_id, "deployment": v.deployment, "reason": v.reason} for v in victims]


def _plan_json(ld, item_plan, inv) -> dict:
    p = item_plan.plan
    return {
        "deployment": ld.deployment.name,
        "priority": item_plan.item.priority,
        "preempts": _victims_json(item_plan.preempts),
        "preemptedBy": _victims_json(item_plan.preempted),
        "preemption": item_plan.decision or None,
        "productsSkipped": list(item_plan.products_skipped),
        "requested": p.request.count,
        "placed": len(p.placements),
        "product": p.product,
        "gang": None if p.gang is None else {"nodes": p.gang.nodes, "gpusPerNode": p.gang.per_node},
        "replicas": [
            {"members": [{"node": m.node, "domain": m.domain, "devices": list(m.devices), "env": m.env,
                          "warm": p.request.is_warm(inv.node(m.node))} for m in r.members]}
            for r in p.placements
        ],
        "cuda": None if p.request.cuda is None else {
            "version": ".".join(map(str, p.request.cuda.version)), "source": p.request.cuda.source,
            "minorVersionCompatibility": p.request.cuda.minor_version_ok},
        "skipped": [{"reason": c.reason, "nodes": list(c.nodes)} for c in p.skipped],
        "explanation": p.explain(),
        "reasons": [{"reason": c.reason, "nodes": list(c.nodes)} for c in p.reasons],
        "migAdvice": [{"node": a.node, "gpu": a.gpu_index, "plan": a.describe(), "commands": a.commands()}
                      for a in p.advice],
    }


def _print_plan(ld, item_plan, inv) -> None:
    dep = ld.deployment
    p = item_plan.plan
    shape = p.request.shape.describe(p.product, p.gang)
    status = "[green]all placed[/]" if p.complete else f"[red]{len(p.placements)} of {p.request.count} placed[/]"
    console.print(f"[bold]{dep.name}[/] ({ld.path}, priority {item_plan.item.priority}): {p.request.count} replica(s) "
                  f"of {shape}; strategy {p.strategy}: {status}", highlight=False, soft_wrap=True)
    for line in item_plan.products_skipped:
        console.print(f"  skipped {line}", highlight=False, markup=False, soft_wrap=True)
    for v in item_plan.preempts:
        console.print(f"  would preempt {v.replica_id}: {v.reason}", highlight=False, markup=False, soft_wrap=True)
    for v in item_plan.preempted:
        console.print(f"  {v.replica_id} would be preempted: {v.reason}", highlight=False, markup=False,
                      soft_wrap=True)
    if item_plan.decision and not item_plan.preempts:
        console.print(f"  no preemption: {item_plan.decision}", highlight=False, markup=False, soft_wrap=True)
    if p.request.cuda is not None:
        console.print(f"  engine needs {p.request.cuda.describe()}; nodes whose driver cannot run it are skipped",
                      highlight=False, markup=False, soft_wrap=True)
    if p.complete:   # an incomplete plan lists them with its reasons
        for c in p.skipped:
            console.print(f"  skipped {c.describe(examples=5)}", highlight=False, markup=False, soft_wrap=True)
    for i, r in enumerate(p.placements):
        for j, m in enumerate(r.members):
            warm = "warm" if p.request.is_warm(inv.node(m.node)) else "cold"
            lead = f"  replica {i}:" if j == 0 else "   " + " " * len(f"replica {i}:")
            console.print(f"{lead} {m.node} {m.domain} {m.label} ({warm}) "
                          f"CUDA_VISIBLE_DEVICES={m.env.get('CUDA_VISIBLE_DEVICES', '')}",
                          highlight=False, markup=False, soft_wrap=True)
    if not p.complete:
        head = p.explain().split(": ", 1)[0]
        console.print(f"  [red]{head}[/]", highlight=False, soft_wrap=True)
        if p.note:
            console.print(f"    {p.note}", highlight=False, markup=False, soft_wrap=True)
        for c in p.reasons:
            console.print(f"    {c.describe(examples=5)}", highlight=False, markup=False, soft_wrap=True)
    for a in p.advice:
        console.print(f"  MIG repartition advice: {a.describe()}", highlight=False, markup=False, soft_wrap=True)
        for cmd in a.commands():
            console.print(f"    $ {cmd}", style="dim", highlight=False, markup=False, soft_wrap=True)
    console.print()


@app.command("inventory")
def inventory_cmd(
    file: Annotated[Optional[Path], typer.Argument(help="Inventory YAML to validate and summarize.")] = None,
    discover: Annotated[bool, typer.Option(
        "--discover", help="Read this machine's GPUs through NVML and print them as an inventory document.")] = False,
    raw: Annotated[bool, typer.Option(
        "--raw", help="With --discover: print NVML's readings as JSON instead (the format of tests/data/).")] = False,
    node_name: Annotated[Optional[str], typer.Option(
        "--node-name", help="Node name for --discover. Default: this host's name.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML or a table.")] = False,
) -> None:
    """Validate and summarize an inventory file, or discover this machine's GPUs.

    `fleet inventory FILE` checks the file (errors name the node and field, e.g.
    `inventory.yaml nodes[3] (gpu-node-3).gpus[2].product: required ...`) and prints one row per
    node: failure domains, GPUs, NVLink domains, MIG instances, unhealthy GPUs.

    `fleet inventory --discover` reads NVML (nvidia-ml-py) here: GPUs, memory, UUIDs, MIG mode
    and instances, NVLink domains, PCIe link, health (uncorrected ECC, row remapping, clock event
    reasons, temperature); it prints an inventory document that `fleet plan --inventory` accepts.
    Without an NVIDIA driver it says so and lists no GPU. Exit code 2 on an invalid file.
    """
    import yaml

    from fleet.inventory.file import inventory_document

    if discover == (file is not None):
        err_console.print("Give either an inventory FILE or --discover.")
        raise typer.Exit(2)
    if discover:
        from fleet.inventory.model import Inventory
        from fleet.inventory.nvml import PynvmlReader, node_from_nvml

        try:
            snap = PynvmlReader().snapshot()
        except RuntimeError as err:
            err_console.print(f"{err}; no GPU listed.", highlight=False)
            snap = {"devices": []}
        if raw:
            console.print_json(json.dumps(snap))
            return
        name = node_name or _dns_name(socket.gethostname())
        node = node_from_nvml(snap, name, cpu_cores=tuple(sorted(os.sched_getaffinity(0))))
        doc = inventory_document(Inventory((node,)), name=name)
        if as_json:
            console.print_json(json.dumps(doc))
        else:
            print(yaml.safe_dump(doc, sort_keys=False), end="")
        return
    loaded = _load_inventory(file)
    if as_json:
        console.print_json(json.dumps(inventory_document(loaded.inventory, loaded.name, loaded.in_use)))
        return
    console.print(f"{file}: {len(loaded.inventory.nodes)} node(s), {loaded.inventory.gpu_count()} GPU(s): valid",
                  highlight=False, soft_wrap=True)
    for n in loaded.inventory.nodes:
        products = Counter(g.product for g in n.gpus)
        domains = [d for d in n.domains if len(d) > 1]
        migs = Counter(m.profile for g in n.gpus for m in g.mig_instances)
        sick = [f"GPU{g.index} ({', '.join(g.health.problems())})" for g in n.gpus if not g.health.healthy]
        taken = sum(1 for g in n.gpus for d in (g.uuid, *(m.uuid for m in g.mig_instances)) if loaded.in_use[d])
        where = "/".join(x for x in (n.zone, n.rack, n.network_block, n.nvlink_fabric) if x)
        parts = [
            f"  {n.name}" + (f" [{where}]" if where else "") + ":",
            ", ".join(f"{c}x {p}" for p, c in products.items()) or "no GPU",
            "NVLink " + (" ".join("{" + ",".join(str(g.index) for g in d) + "}" for d in domains) or "none")
            + ("" if n.topology_known else " (topology not reported)"),
        ]
        if migs:
            parts.append("MIG " + ", ".join(f"{c}x {p}" for p, c in sorted(migs.items())))
        if sick:
            parts.append("unhealthy: " + "; ".join(sick))
        if taken:
            parts.append(f"{taken} device(s) in use")
        console.print("; ".join([parts[0] + " " + parts[1], *parts[2:]]), highlight=False, markup=False, soft_wrap=True)


def _dns_name(host: str) -> str:
    """A host name as a DNS-1123 node name (lower case, other characters become '-')."""
    name = re.sub(r"[^a-z0-9.-]+", "-", host.lower()).strip("-.")
    return name or "local"
