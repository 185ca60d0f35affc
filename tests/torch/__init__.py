"""PyTorch tests. A package on purpose: without this file pytest would put tests/ on sys.path,
and ``import torch`` would find this folder instead of torch."""
