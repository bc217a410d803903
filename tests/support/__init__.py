"""The tests' shared harness: fakes of Fleet's own wrappers (`fakes`, `fake_kube`), inventories,
the router in-process (`router`), Helm rendering (`helm`) and the CRD schema check (`schema`).
Stand-ins for external components (API server, hub, NVML, proxy) live in `fleet.testing`."""
