"""The kubelet device plugin of matrixpool's cards (device plugin API v1beta1, gRPC), run on
every accelerator node by the chart's device plugin DaemonSet (``devicePlugin.enabled``) as
``python -m matrixpool.deviceplugin``, under a ServiceAccount of its own.

It advertises ``cardsPerNode`` cards as devices ``"0".."N-1"`` of the extended resource the
SuperNodes count (``cardResource``), unhealthy when the node's annotation
``matrixpool.dev/unhealthy-cards`` or a health file names them, and hands each container of a
pod exactly the cards the operator chose for it (``matrixpool.dev/cards``), since the kubelet
itself would pick any free ones (DESIGN.md, real pods contract).

Modules, callers first::

    __main__   flags, logging, signals; builds the three below
    plugin     serve on a unix socket, register with the kubelet, again after its restarts
    service    the DevicePlugin servicer: devices and health, preferred allocation, Allocate
    pairing    pure: which pod a device request is for, and which cards it gets
    kube       the Kubernetes API behind a small interface (tests pass a fake)
    health     the health file
    api_pb2, api_pb2_grpc
               generated from tools/deviceplugin/api.proto by tools/deviceplugin/generate.sh

Errors: none of its own. The API's and gRPC's are logged where they happen and answered by
falling back on the kubelet's choice of devices (pairing) or by retrying (registration, the
node watch).

What may be written here: what a kubelet device plugin does on one node. It imports no
controller and no operator state.
"""
