"""An agent's parameter downloads and version checks reuse one kept connection to the aggregator.

Each used to open a connection of its own: websockets closed it after every
answer, and the agent's urllib client never kept one.
"""

from __future__ import annotations

import asyncio

from crowdtrain_agent import pooled_http
from crowdtrain_agent.fetch import fetch_params, still_current
from crowdtrain_agent.protocol import SliceRoute
from crowdtrain_backbone.server import BackboneServer

from .conftest import TWO_SLICE_PARAMS, ticket


def _three_downloads_and_a_check(routes: list[SliceRoute]) -> bool:
    etags: list[str] = []
    fetch_params(routes, 0, TWO_SLICE_PARAMS, ticket=ticket(50), etags=etags)
    fetch_params(routes, 0, TWO_SLICE_PARAMS, ticket=ticket(50))
    fetch_params(routes, 0, TWO_SLICE_PARAMS, ticket=ticket(50))
    return still_current(routes, 0, etags, ticket=ticket(50))


async def test_downloads_and_version_checks_share_one_connection(
    two_slices: list[SliceRoute], backbone: BackboneServer
) -> None:
    pooled_http.POOL.clear()  # another test's aggregator may have had this port

    current = await asyncio.to_thread(_three_downloads_and_a_check, two_slices)

    pool = pooled_http.POOL.connection_from_url(backbone.url)
    assert current
    assert pool.num_requests == 8 and pool.num_connections == 1  # per slice: 3 downloads and a check
