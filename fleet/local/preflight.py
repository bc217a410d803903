"""`fleet up`'s pre-flight checks: nothing starts unless every deployment can run on this machine.

Owns `preflight` (each deployment's engine installed, its weights present, a replica placeable on
this machine's inventory, the model held by a GPU of it as the controller will compute it, the
NVIDIA driver able to run the engine's CUDA; each port free), `PreflightError` (every problem,
one per line) and `port_problem`. Called by `fleet.local.up.run_up` before anything starts, and
by tests.
"""

from __future__ import annotations

import socket

from fleet.controller.model_memory import memory_need_or_reason
from fleet.engines.kinds import ModelUnavailable, get_engine
from fleet.inventory import Inventory
from fleet.placement import PlacementRequest, get_strategy
from fleet.sources import SourceError, parse_source
from fleet.spec import LoadedDeployment


class PreflightError(Exception):
    """A deployment cannot run on this machine; ``problems`` lists why, one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None. Binds with SO_REUSEADDR, as the
    router's server (uvicorn) does, so sockets in TIME-WAIT after a previous run do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            return f"{host}:{port} is not free: {err.strerror}"
    return None


def preflight(loaded: list[LoadedDeployment], inventory: Inventory, ports: dict[str, tuple[str, int]]) -> None:
    """Check everything that would make `fleet up` half-start: each deployment's engine is
    installed, its weights are present and a replica fits the inventory (and, for weights on this
    machine or in its weight cache, a GPU of it holds the model:
    `fleet.controller.model_memory.memory_need_or_reason`; and a GPU node's NVIDIA
    driver can run the engine's CUDA: `fleet.placement.compat`; and its ``--max-model-len`` is
    one vLLM accepts for the model: `fleet.models.memory.MemoryNeed.max_len_problem`, named under
    ``spec.engine.args`` and not again as a placement problem); each named port
    (``{"router": (host, port)}``) is free and no other of them. Raises PreflightError listing every problem."""
    problems = []
    placer = get_strategy()
    for ld in loaded:
        dep = ld.deployment
        where = f"{ld.path}[{ld.index}] ({dep.name})"
        engine = get_engine(dep.spec.engine.kind)
        problem = engine.preflight()
        if problem:
            problems.append(f"{where} spec.engine.kind: {problem}")
        if dep.spec.model.parsed_source.remote:   # fetched into the weight cache at start
            try:
                parse_source(dep.spec.model.source, ld.base_dir)
            except SourceError as err:
                problems.append(f"{where} spec.model.source: {err}")
        else:
            try:
                engine.model_argument(dep.engine_launch(ld.base_dir))
            except ModelUnavailable as err:
                problems.append(f"{where} spec.model.source: {err}")
        need, _ = memory_need_or_reason(ld, hub=False)   # unreadable here: the controller tells at placement
        if need is not None and (too_long := need.max_len_problem) is not None:
            problems.append(f"{where} spec.engine.args: {too_long}")
            need = None   # the placement check below: the shape and the driver alone
        request = PlacementRequest.for_deployment(dep, 1, memory=need)   # driver/CUDA too
        unfit = placer.fits_at_all(request.shape, inventory, memory=request.memory, cuda=request.cuda)
        if unfit is not None:
            problems.append(f"{where} spec.resources: cannot place a replica on this machine: {unfit.reason}")
    claimed: dict[int, str] = {}
    for what, (host, port) in ports.items():
        if port in claimed:   # two of fleet up's own servers on one port: the second would not bind
            problems.append(f"{what} port {port} is also the {claimed[port]} port: give one of them another")
            continue
        claimed[port] = what
        problem = port_problem(host, port)
        if problem:
            problems.append(f"{what} port {problem}")
    if problems:
        raise PreflightError(problems)
