-- The queue of lease requests waiting for the commit that makes room (A.ready_at). A: channel (the
-- request's socket, '' for none), want, ready_at, leave (an earlier place to drop, '' for none),
-- pass_on (1: a woken socket had no request left to serve; wake the next one whose step is open in its
-- place. 2: a released lease put samples back in the open step; wake the first waiting, whatever it waits for).
if A.leave ~= '' then redis.call('ZREM', K_WAIT, A.leave) end
if A.pass_on == 1 or A.pass_on == 2 then
  local upto = A.pass_on == 2 and '+inf' or meta('open')
  local next = redis.call('ZRANGEBYSCORE', K_WAIT, '-inf', upto, 'LIMIT', 0, 1)[1]
  if not next then return cjson.encode({}) end
  redis.call('ZREM', K_WAIT, next)
  return cjson.encode({woken = {string.match(next, '^%d+:%d+:(.+)$')}})
end
if A.channel == '' then return cjson.encode({}) end
if meta('open') >= A.ready_at then return cjson.encode({ready = true}) end
local member = string.format('%012d', redis.call('HINCRBY', K_META, 'wseq', 1)) .. ':' .. A.want .. ':' .. A.channel
redis.call('ZADD', K_WAIT, A.ready_at, member)
return cjson.encode({member = member})
