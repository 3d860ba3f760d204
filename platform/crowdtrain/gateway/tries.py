"""Which connection try of a peer is its newest, so a stale try never replaces a working socket.

Under load a site process may act on a handshake minutes late: the client
timed out, tried again, and its newer try was welcomed by another process in
the meantime. Without an order, the stale try's ``take_over`` would close the
newer socket with 4012, which agents and aggregators take as "another process
runs on this token" and stop for good: the scale bench lost working agents
that way while 10,000 joined. Clients name each try (``CONNECTION_HEADER``:
random per process, counting up), and one atomic script per connection keeps
the newest try seen for each device or aggregator. A try older than that, of
the same client process, is refused before it has any effect. Tries of
different processes are not ordered: the newer connection wins, as before.
"""

from __future__ import annotations

from crowdtrain.scheduler.hotstate import hot_state
from crowdtrain_agent.protocol import CONNECTION_HEADER, ConnectionTry, parse_connection_try

# A day: far longer than any handshake can be late, and the key goes with the peer.
KEPT_S = 86_400

# KEYS[1]: the group's newest try; ARGV: instance, number, seconds kept. 1 when this try may take over.
_CLAIM = """
local newest = redis.call('GET', KEYS[1])
if newest then
  local instance, number = string.match(newest, '^(%x+)/(%d+)$')
  if instance == ARGV[1] and tonumber(number) > tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1] .. '/' .. ARGV[2], 'EX', tonumber(ARGV[3]))
return 1
"""

_HEADER = CONNECTION_HEADER.lower().encode("latin-1")


def connection_try(headers: list[tuple[bytes, bytes]]) -> ConnectionTry | None:
    """The try an ASGI handshake names; None for clients that send none (older ones, test harnesses)."""
    value = next((v.decode("latin-1") for k, v in headers if k.lower() == _HEADER), None)
    return parse_connection_try(value)


def may_take_over(group: str, attempt: ConnectionTry) -> bool:
    """Record ``attempt`` as ``group``'s newest try, unless the same client already made a newer one."""
    state = hot_state()
    script = state.client.register_script(_CLAIM)
    key = f"{state.prefix}:newest-try:{group}"
    return bool(script(keys=[key], args=[attempt.instance, attempt.number, KEPT_S]))
