-- Forget every step from A.version on: all leases in flight (active, or accepted and pending in
-- aggregator memory that is lost) and the samples of the rolled-back steps (A.ranges, global
-- [epoch, start, count]) go back to the redo queue. A lease and its backup give theirs back once.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local out, given = {}, {}
local reason = 'rolled back to version ' .. A.version
for _, raw in ipairs(redis.call('HVALS', K_LEASES)) do
  local l = cjson.decode(raw)
  if l.st == 'active' or l.st == 'accepted' then
    local pair = (l.tw ~= 0) and math.min(l.id, l.tw) or l.id
    if not given[pair] then
      given[pair] = true
      for _, r in ipairs(l.r) do redis.call('RPUSH', K_RET, r[1] .. ':' .. r[2] .. ':' .. r[3]) end
    end
    l.st, l.why, l.t1, l.tw = 'rejected', reason, now, 0
    lease_put(l)
    tomb(l.id)
    out[#out + 1] = {l.id, 'rejected', reason}
  end
end
for _, r in ipairs(A.ranges) do redis.call('RPUSH', K_RET, r[1] .. ':' .. r[2] .. ':' .. r[3]) end
redis.call('DEL', K_RES, K_FILL, K_ACC, K_DL, K_SOFT, K_HOLD, K_WAIT)
forget_shares(meta('open'), meta('open') + meta('stale'))
redis.call('HSET', K_META, 'open', A.version)
redis.call('HINCRBY', K_META, 'gen', 1)
return cjson.encode({retired = out})
