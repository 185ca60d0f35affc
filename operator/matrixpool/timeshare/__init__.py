"""Pure day/night capacity policy (no kopf, no Kubernetes client)."""
