"""Backends run replica processes: `local` (child processes on this machine) now, Kubernetes
later. Both implement `fleet.backends.base.Backend`."""
