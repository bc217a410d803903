"""The controller: one reconcile loop that converges each deployment's desired replicas to the
observed ones, through a backend (`fleet.local` processes or `fleet.k8s` pods).

`reconcile` holds the `Controller` and its tick; every other module is one collaborator of it. The
list of the parts and what each owns is docs/controller.md ("The parts"). Assembled by
`fleet.control_plane` for `fleet.local.up` and `fleet.k8s.operator`.
"""
