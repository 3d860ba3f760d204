-- The queue of lease requests waiting for the commit that makes room (A.ready_at). A: channel (the
-- request's socket, '' for none), want, owner (the device's volunteer, 0 unknown), ready_at, leave (an
-- earlier place to drop, '' for none), skip (volunteers, comma-separated, for pass_on 3), pass_on:
--   1: a woken socket had no request left to serve; wake the next one whose step is open in its place.
--   2: a released lease put samples back in the open step; wake the first waiting, whatever it waits for.
--   3: a verification copy waits; it needs no room in a step, so wake the first request, whatever it
--      waits for, of a volunteer not in A.skip (the copy's owner and earlier copies' volunteers).
-- A member is 'seq:want:o<owner>:channel' ('seq:want:channel' from before owners were kept).
local function channel_of(member)
  local rest = string.match(member, '^%d+:%d+:(.+)$')
  return string.match(rest, '^o%d+:(.+)$') or rest
end
if A.leave ~= '' then redis.call('ZREM', K_WAIT, A.leave) end
if A.pass_on == 1 or A.pass_on == 2 then
  local upto = A.pass_on == 2 and '+inf' or meta('open')
  local next = redis.call('ZRANGEBYSCORE', K_WAIT, '-inf', upto, 'LIMIT', 0, 1)[1]
  if not next then return cjson.encode({}) end
  redis.call('ZREM', K_WAIT, next)
  return cjson.encode({woken = {channel_of(next)}})
end
if A.pass_on == 3 then
  local skip = {}
  for owner in string.gmatch(A.skip, '%d+') do skip[owner] = true end
  -- A bounded look: a copy nobody here may take waits for the next request that can.
  for _, member in ipairs(redis.call('ZRANGE', K_WAIT, 0, 15)) do
    local owner = string.match(member, '^%d+:%d+:o(%d+):')
    if owner and owner ~= '0' and not skip[owner] then
      redis.call('ZREM', K_WAIT, member)
      return cjson.encode({woken = {channel_of(member)}})
    end
  end
  return cjson.encode({})
end
if A.channel == '' then return cjson.encode({}) end
if meta('open') >= A.ready_at then return cjson.encode({ready = true}) end
local member = string.format('%012d', redis.call('HINCRBY', K_META, 'wseq', 1)) .. ':' .. A.want .. ':o' ..
  A.owner .. ':' .. A.channel
redis.call('ZADD', K_WAIT, A.ready_at, member)
return cjson.encode({member = member})
