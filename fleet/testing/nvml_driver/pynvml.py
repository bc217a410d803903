"""A STAND-IN for nvidia-ml-py's `pynvml` module on one node of the cluster in a box: put this
folder first on PYTHONPATH and ``import pynvml`` answers from the node's JSON state file
(``$FLEET_FAKE_NVML``), filtered to ``$NVIDIA_VISIBLE_DEVICES``, through
`fleet.testing.fake_nvml.FileNvml` (its docstring says what it answers and how Xid events are
delivered). Fleet's production code imports `pynvml` as always and cannot tell.

Every public name here exists in nvidia-ml-py (tests/unit/test_nvml_driver.py checks), so code
that works against this module does not call something the real one lacks.
"""

from fleet.testing.fake_nvml import FileNvml as _FileNvml

_driver = _FileNvml()
NVMLError = _driver.NVMLError
for _name in dir(_driver):
    if _name.startswith(("nvml", "NVML_", "c_nvml", "byref")):
        globals()[_name] = getattr(_driver, _name)
del _name
