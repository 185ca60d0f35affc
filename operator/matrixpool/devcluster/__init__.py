"""The local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok), real
nodes, the process kubelet (``matrixpool sim``), the trainers and the demo, used by
``matrixpool cluster``, the demo, the benchmarks and the tests.

What may be written here: what a user's cluster or a user's workload would be. The operator
never imports it (import-linter); the trainers read only what a user's job could
(``matrixpool_recovery``, the pod's annotations and environment).
"""
