"""The kubelet's PodResources API (v1, as Kubernetes 1.20 serves it): `api.proto` and the Python
modules `grpc_tools.protoc` generated from it (`api_pb2`: the messages; `api_pb2_grpc`:
``PodResourcesListerStub`` for the client, ``PodResourcesListerServicer`` and
``add_PodResourcesListerServicer_to_server`` for a server). Used by `fleet.agent.pod_devices`
(the node agent's client) and the kubelet stand-in's server (fleet/testing/k8s/podresources.py).
The command that regenerates them is in the file GENERATED beside them.
"""
