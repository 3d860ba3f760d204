-- The database holds step A.step of timeline A.line now: open the next one. Idempotent. Returns the next
-- full step (a lease reported ahead may complete several at once) and the waiting requests to wake.
-- A step of an older timeline (its writer stalled past a rollback, and the redone steps reached its index
-- again) changes nothing: the open step's leases are not that step's.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local s = A.step
local open = meta('open')
local woken = {}
if open == s and (A.line or 0) == meta('line') then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_ACC, s, s)) do
    redis.call('HDEL', K_LEASES, id)
    redis.call('HDEL', LC, id)
  end
  redis.call('ZREMRANGEBYSCORE', K_ACC, s, s)
  redis.call('HDEL', K_FILL, s)
  redis.call('HDEL', K_RES, s)
  redis.call('DEL', share_key(s))
  open = s + 1
  redis.call('HSET', K_META, 'open', open, 'opened_at', now)
  -- A commit makes room for one global batch: wake that many samples' worth of waiting requests.
  local room, target = 0, meta('target')
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', K_WAIT, '-inf', open)) do
    if room >= target then break end
    local want, channel = string.match(member, '^%d+:(%d+):(.+)$')
    channel = string.match(channel, '^o%d+:(.+)$') or channel -- 'o<owner>:' since owners are kept
    room = room + tonumber(want)
    woken[#woken + 1] = channel
    redis.call('ZREM', K_WAIT, member)
  end
end
return cjson.encode({open = open, commit = full_step() or false, woken = woken})
