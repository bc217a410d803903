"""The name patterns Fleet's documents share: a Kubernetes DNS-1123 label and an NVIDIA MIG profile.

Owns `DNS_LABEL`, `MIG_PROFILE` (both anchored: a whole value must match) and
`MIG_PROFILE_IN_TEXT` (a MIG profile inside a device name, as NVML and the device plugin report
a MIG instance: ``NVIDIA H100 80GB HBM3 MIG 3g.40gb``). Used by `fleet.spec` (deployment names,
``spec.resources.migProfile``), `fleet.inventory.file` (MIG instance profiles),
`fleet.k8s.node_facts` (the device plugin's MIG devices), `fleet.k8s.crd` (the CRD's
``migProfile`` pattern) and `fleet.cli.explain` (the patterns ``fleet explain`` prints). Imports
nothing of Fleet's.
"""

from __future__ import annotations

import re

_MIG_PROFILE_NAME = r"[1-7]g\.[0-9]+gb(\+me)?"

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""A Kubernetes DNS-1123 label: at most 63 characters (checked apart), lower-case letters, digits
and '-' inside (kubernetes.io/docs/concepts/overview/working-with-objects/names)."""

MIG_PROFILE = re.compile(rf"^{_MIG_PROFILE_NAME}$")
"""An NVIDIA MIG profile name: ``1g.10gb``, ``3g.40gb``, ``1g.20gb+me`` (compute slices 1-7, memory
in GB, ``+me`` with the media engines; NVIDIA MIG user guide, "Supported profiles")."""

MIG_PROFILE_IN_TEXT = re.compile(rf"\b({_MIG_PROFILE_NAME})\b")
"""A MIG profile name inside a longer text; group 1 is the profile."""
