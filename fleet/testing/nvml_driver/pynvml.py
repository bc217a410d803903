"""A STAND-IN for nvidia-ml-py's `pynvml` module on one node of the cluster in a box or the real
node: put this folder first on PYTHONPATH and ``import pynvml`` answers from the node's JSON state
file (``$FLEET_FAKE_NVML``), filtered to ``$NVIDIA_VISIBLE_DEVICES``, through `FileNvml` of
fleet/testing/nvml_driver/fleet_nvml_stand_in.py (its docstring says what it answers and how Xid
events are delivered). Fleet's production code imports `pynvml` as always and cannot tell.

Needs the standard library and its sibling file only, which it loads by path: a container that
has this folder mounted (fleet/testing/k8s/deviceplugin_grpc.py, fleet/testing/k8s/nvidia_runtime.py)
reads the fake NVML whatever its image carries.

Every public name here exists in nvidia-ml-py (tests/unit/test_nvml_driver.py checks), so code
that works against this module does not call something the real one lacks.
"""

import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_IMPL = "fleet_nvml_stand_in"
_impl = _sys.modules.get(_IMPL)
if _impl is None:
    _spec = _util.spec_from_file_location(_IMPL, _Path(__file__).resolve().with_name(f"{_IMPL}.py"))
    _impl = _util.module_from_spec(_spec)
    _sys.modules[_IMPL] = _impl   # registered before it runs, as an import does
    _spec.loader.exec_module(_impl)

_driver = _impl.FileNvml()
NVMLError = _driver.NVMLError
for _name in dir(_driver):
    if _name.startswith(("nvml", "NVML_", "c_nvml", "byref")):
        globals()[_name] = getattr(_driver, _name)
del _name
