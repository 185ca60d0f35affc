"""Kubernetes resource quantities (``500m``, ``2Gi``, ``1e3``) as exact numbers and as the whole
amounts placement compares.

Pure (no kopf, no Kubernetes client; ``kubernetes.utils.parse_quantity`` does the same but may
not be imported here). :mod:`matrixpool.placement.nodefit` parses pod templates and node
allocatable with it, and :mod:`matrixpool.k8s.convert` the pods and nodes of the API.

Amounts are kube-scheduler's: ``cpu`` in millicores, every other resource in whole units
(bytes for memory), rounded up. Errors: :class:`ValueError` for a malformed quantity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction

CPU = "cpu"
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # powers of 1024
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_FORM = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)


def parse(text: object) -> Fraction:
    """The exact value of a quantity: ``"500m"`` → 1/2, ``"2Gi"`` → 2147483648."""
    match = _FORM.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number = Fraction(match["number"])
    if match["exponent"]:
        return number * Fraction(10) ** int(match["exponent"][1:])
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * Fraction(1024) ** _BINARY[suffix]
    return number * Fraction(10) ** _DECIMAL[suffix]


def amount(resource: str, text: object) -> int:
    """The whole amount placement compares: millicores for cpu, else units; rounded up."""
    value = parse(text)
    return math.ceil(value * 1000 if resource == CPU else value)


def amounts(resources: Mapping[str, object]) -> dict[str, int]:
    """:func:`amount` of every entry of a resource list; malformed entries are left out (the
    API server rejects them, so only a hand-made object can carry one)."""
    result: dict[str, int] = {}
    for name, text in resources.items():
        try:
            result[str(name)] = amount(str(name), text)
        except ValueError:
            continue
    return result


def show(resource: str, value: int) -> str:
    """An amount in a reason message: ``cpu 1500m``, ``memory 2Gi``, else the bare number."""
    if resource == CPU:
        return f"{value // 1000}" if value % 1000 == 0 else f"{value}m"
    for suffix, power in sorted(_BINARY.items(), key=lambda s: -s[1]):
        unit = 1024**power
        if value >= unit and value % unit == 0:
            return f"{value // unit}{suffix}"
    return str(value)
