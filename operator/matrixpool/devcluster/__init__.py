"""The local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok) used by
``matrixpool cluster``, the demo and the integration tests."""
