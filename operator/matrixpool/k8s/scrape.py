"""Reading Prometheus ``/metrics`` of pods over HTTP, for the inference autoscaler
(:mod:`matrixpool.controllers.autoscaler`, through :class:`matrixpool.k8s.executor.Live`).

All URLs at once, each bounded by a timeout; an answer that is not 200, a refused connection or
a timeout reads as None (that pod counts for nothing this period), never as an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import structlog

log = structlog.get_logger(__name__)
MAX_BYTES = 4 << 20  # a /metrics answer larger than this is not an inference server's


async def scrape(urls: Sequence[str], timeout: float) -> dict[str, str | None]:
    """URL → the text it answered, or None."""
    if not urls:
        return {}
    limit = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=limit) as session:
        texts = await asyncio.gather(*(_one(session, url) for url in urls))
    return dict(zip(urls, texts, strict=True))


async def _one(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as answer:
            if answer.status != 200:
                log.debug("metrics not read", url=url, status=answer.status)
                return None
            body = await answer.content.read(MAX_BYTES + 1)
            return body.decode() if len(body) <= MAX_BYTES else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as error:
        log.debug("metrics not read", url=url, error=repr(error))
        return None
