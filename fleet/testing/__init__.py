"""STAND-INS shared by the tests and the benchmarks, for what cannot run on a development machine.

Never imported by Fleet itself (the layer test, tests/unit/test_layers.py, checks) and not
shipped in the wheel (pyproject.toml excludes ``fleet.testing*``); `loadtests/` imports these and
not `tests/`. Each module says what real component it stands in for: `k8s` (a Kubernetes API
server and a process kubelet) and `hub_server` (a Hugging Face Hub and a plain HTTP file server).
Stand-ins that only the tests use live in `tests/support`.
"""
