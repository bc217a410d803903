"""Fleet on Kubernetes: the `InferenceDeployment` CRD generated from the pydantic spec
(`fleet.k8s.crd`), the one thin wrapper every cluster call goes through (`fleet.k8s.client`),
the Kubernetes backend of the replica protocol (`fleet.k8s.backend`: a replica is a Pod) and the
operator that runs the same controller `fleet up` runs (`fleet.k8s.operator`). Started by
`fleet operator`; `fleet crd` prints the CRD (fleet.cli.k8s). See docs/kubernetes.md.
"""
