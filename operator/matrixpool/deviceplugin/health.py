"""Card health from a file on the node, for a health agent that is not a Kubernetes client:
the file holds the unhealthy cards in the format of ``matrixpool.dev/unhealthy-cards``
(``"3,5"``; empty or absent: none). Read by :mod:`matrixpool.deviceplugin.service` at every
poll of ListAndWatch, beside the node's annotation.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from matrixpool.api import labels

log = structlog.get_logger(__name__)


class HealthFile:
    """The unhealthy cards in ``path`` (None: no file configured). A file that cannot be read
    or parsed keeps the last value read (a writer caught halfway must not heal a card)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path  # the file; None: health comes from the node annotation alone
        self._last: frozenset[int] = frozenset()  # the last value parsed
        self._bad: str | None = None  # the last unreadable content, logged once

    def cards(self) -> frozenset[int]:
        if self.path is None:
            return frozenset()
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._last = frozenset()
            return self._last
        except OSError as error:
            log.warning("health file unreadable", path=str(self.path), error=str(error))
            return self._last
        try:
            self._last = labels.parse_cards(text.strip())
        except ValueError:
            if text != self._bad:
                log.warning("health file unparsable, kept its last value", content=text[:200])
            self._bad = text
        return self._last
