"""The kubelet's device-plugin API (v1beta1, as Kubernetes 1.20.2 serves it): `api.proto` and the
Python modules `grpc_tools.protoc` generated from it (`api_pb2`: the messages; `api_pb2_grpc`:
``RegistrationStub`` and ``add_RegistrationServicer_to_server`` for the kubelet's side,
``DevicePluginStub``, ``DevicePluginServicer`` and ``add_DevicePluginServicer_to_server`` for a
plugin's). Used by the device-plugin stand-in that a real kubelet talks to
(fleet/testing/k8s/deviceplugin_grpc.py) and by its tests' fake kubelet. The command that
regenerates them is in the file GENERATED beside them.
"""
