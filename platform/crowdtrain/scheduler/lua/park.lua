-- A lease request waits for the commit that makes room (A.ready_at), or leaves the queue (A.leave).
if A.leave ~= '' then redis.call('ZREM', K_WAIT, A.leave) end
if A.channel == '' then return cjson.encode({}) end
if meta('open') >= A.ready_at then return cjson.encode({ready = true}) end
local member = string.format('%012d', redis.call('HINCRBY', K_META, 'wseq', 1)) .. ':' .. A.want .. ':' .. A.channel
redis.call('ZADD', K_WAIT, A.ready_at, member)
return cjson.encode({member = member})
