"""router.kv.prompt_blocks across processes: the block hashes and affinity keys are the same in every
interpreter, whatever its hash seed (tests/unit/test_prompt_blocks.py: the rest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_hashes_are_the_same_in_every_process() -> None:
    """Two routers must compute the same blocks: no dependence on PYTHONHASHSEED."""
    code = ("import json; from router.kv.prompt_blocks import route_request; "
            "print(json.dumps([list(route_request(d, s).block_hashes) + [route_request(d, s).affinity_key()] "
            "for d, s in [({'prompt': 'abc ' * 300}, None), ({'prompt': list(range(300))}, None), "
            "({'messages': [{'role': 'user', 'content': 'hello ' * 100}]}, 'sess-1')]]))")  # fmt: skip
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                              check=True, timeout=60).stdout))  # fmt: skip
    assert outs[0] == outs[1] and all(outs[0])
