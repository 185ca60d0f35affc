"""Pure topology-aware gang placement (no kopf, no Kubernetes client)."""
