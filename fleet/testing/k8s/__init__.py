"""STAND-IN of a Kubernetes API server (`apiserver`, over the object `store`), a process kubelet
(`kubelet`) and node objects as GPU Feature Discovery labels them (`nodes`). The real
`kubernetes` client runs against it; it is not a real API server (docs/kubernetes.md says what
differs)."""
