"""The tests' shared harness: fakes of Fleet's own wrappers (`fakes`, `fake_kube`), the controller
on fake time (`controller`: `ControllerHarness.tick`), inventories, the router in-process
(`router`), Helm rendering (`helm`), the CRD schema check (`schema`), condition waits with
deadlines (`waits`), the unit tier's guards (`guards`), `fleet up` as a child process
(`fleet_up`), open-loop load (`load`), `fleet` over a faulty stand-in NVML (`fake_gpu_fleet`)
and the weight-cache tests' hub fixture (`weights`). Stand-ins for external components (API
server, hub, NVML, proxy) that the benchmarks also use live in `fleet.testing`."""
