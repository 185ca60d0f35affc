"""Checkpoint tiers, the node checkpoint daemon, the trainer client and the recovery policy.

Imports neither kopf nor a Kubernetes client: it ships inside training images.
"""
