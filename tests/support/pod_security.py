"""The Pod Security Standards' levels of a pod spec, for the chart and engine-pod tests: the
checks of kubernetes.io/docs/concepts/security/pod-security-standards (policy version v1.30)
that Fleet's pods can meet or fail. Not checked, because no Fleet pod sets them: AppArmor,
SELinux options, procMount, sysctls, Windows HostProcess.

`violations(spec, level)` lists what keeps a pod spec from ``baseline`` or ``restricted``;
`level(spec)` is the strictest level it meets."""

from __future__ import annotations

from typing import Any

# Baseline: capabilities a container may add (the container runtime's default set).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # fmt: skip
# Restricted: the volume types allowed.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}  # fmt: skip


def _containers(spec: dict) -> list[dict]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _baseline(spec: dict) -> list[str]:
    out = [f"host namespace: {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    out += [f"hostPath volume {v['name']!r}" for v in spec.get("volumes") or [] if "hostPath" in v]
    pod_seccomp = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        out.append("seccomp Unconfined")
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"container {c['name']!r} privileged")
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"container {c['name']!r} adds {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"container {c['name']!r} hostPort")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"container {c['name']!r} seccomp Unconfined")
    return out


def _restricted(spec: dict) -> list[str]:
    out = [f"volume {v['name']!r} of type {t}" for v in spec.get("volumes") or []
           for t in [next((k for k in v if k != "name"), "?")] if t not in RESTRICTED_VOLUMES]  # fmt: skip
    pod_sc = spec.get("securityContext") or {}
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        name = repr(c["name"])
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name} may escalate privileges")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"container {name} without runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"container {name} runs as UID 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"container {name} without a seccomp profile")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"container {name} does not drop ALL capabilities")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"container {name} adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return out


def violations(spec: dict[str, Any], level: str) -> list[str]:
    """What keeps pod ``spec`` from ``level`` (``baseline`` or ``restricted``); [] when it meets it."""
    if level == "baseline":
        return _baseline(spec)
    if level == "restricted":
        return _baseline(spec) + _restricted(spec)
    raise ValueError(f"level {level!r}: baseline or restricted")


def level(spec: dict[str, Any]) -> str:
    """The strictest Pod Security level pod ``spec`` meets: restricted, baseline or privileged."""
    if not violations(spec, "restricted"):
        return "restricted"
    return "baseline" if not violations(spec, "baseline") else "privileged"
