"""Every test waits through tests/support/waits.py: no test file (of any tier, the shared harness
included) defines its own ``until``/``eventually`` helper or hand-rolls a deadline loop (a
``deadline = time.monotonic() + ...``, a ``while`` loop whose test reads a clock, or a loop of
sleeps that breaks once a condition holds).

A loop that reads a clock for another reason (a fake API server timing out its own watch, a load
generator pacing its sends) says so with a ``# not a wait: <why>`` comment on the flagged line."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
EXEMPT = {TESTS / "support" / "waits.py"}
HELPER_NAMES = {"until", "_until", "until_true", "eventually", "_eventually", "wait_until", "async_wait_until"}
CLOCKS = {"monotonic", "perf_counter", "time"}   # time.monotonic(), loop.time(), time.time(), ...
PRAGMA = "# not a wait:"


def _reads_a_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLOCKS
               and not n.args for n in ast.walk(node))


def _sleeps(body: list[ast.stmt]) -> bool:
    """A statement of ``body`` is a bare ``sleep(...)`` or ``await asyncio.sleep(...)``."""
    for stmt in body:
        if not isinstance(stmt, ast.Expr):
            continue
        call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
        if isinstance(call, ast.Call):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if name == "sleep":
                return True
    return False


def _breaks_on_a_condition(body: list[ast.stmt]) -> bool:
    """A statement of ``body`` is ``if <condition>: break`` (or ``return``)."""
    return any(isinstance(stmt, ast.If) and isinstance(stmt.body[0], (ast.Break, ast.Return)) for stmt in body)


def offences(source: str) -> list[tuple[int, str]]:
    """(line, what) for each own wait helper and hand-rolled deadline loop in ``source``."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in HELPER_NAMES:
            found.append((node.lineno, f"defines its own wait helper `{node.name}`"))
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Add)
              and _reads_a_clock(node.value)):
            found.append((node.lineno, "computes a deadline from a clock"))
        elif isinstance(node, ast.While) and _reads_a_clock(node.test):
            found.append((node.lineno, "loops until a clock says stop"))
        elif isinstance(node, (ast.For, ast.While)) and _sleeps(node.body) and _breaks_on_a_condition(node.body):
            found.append((node.lineno, "polls a condition in a loop of sleeps"))
    return [(line, what) for line, what in found if PRAGMA not in lines[line - 1]]


def test_no_test_file_writes_its_own_wait() -> None:
    bad = [f"{path.relative_to(TESTS.parent)}:{line}: {what}; use tests/support/waits.py"
           for path in sorted(TESTS.rglob("*.py")) if path not in EXEMPT
           for line, what in offences(path.read_text())]
    assert not bad, "\n".join(bad)


def test_the_guard_finds_each_kind_of_hand_rolled_wait() -> None:
    source = '''
async def eventually(check):
    pass

def poll(ready):
    deadline = time.monotonic() + 10
    while not ready():
        time.sleep(0.1)

async def spin(loop, ready):
    start = loop.time()
    while loop.time() - start < 5 and not ready():
        await asyncio.sleep(0.01)

def paced(loop):
    next_s = loop.time() + 1.0   # not a wait: the load's pacing

async def tries(ready):
    for _ in range(100):
        await asyncio.sleep(0.02)
        if ready():
            break
'''
    assert offences(source) == [(2, "defines its own wait helper `eventually`"),
                                (6, "computes a deadline from a clock"),
                                (12, "loops until a clock says stop"),
                                (19, "polls a condition in a loop of sleeps")]
