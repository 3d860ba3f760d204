-- Forget every step from A.version on: all leases in flight (active, or accepted and pending in
-- aggregator memory that is lost) and the samples of the rolled-back steps (A.ranges, global
-- [epoch, start, count]) go back to the redo queue. A lease and its backup give theirs back once.
-- A.committed: the steps the database held before this rollback. An accepted lease of one of them is
-- still here when its writer has not told the hot state yet: its samples are in A.ranges (or in a step
-- kept), and giving them back here too would count them twice. A.line: the campaign's new timeline.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local out, given = {}, {}
local reason = 'rolled back to version ' .. A.version
local committed = A.committed or 0
for _, raw in ipairs(redis.call('HVALS', K_LEASES)) do
  local l = cjson.decode(raw)
  if l.st == 'accepted' and l.s < A.version and l.s < committed then
    -- In a step the rollback keeps: forgotten here as its commit would have (committed.lua).
    redis.call('HDEL', K_LEASES, l.id)
    redis.call('HDEL', LC, l.id)
  elseif l.st == 'active' or l.st == 'accepted' then
    local pair = (l.tw ~= 0) and math.min(l.id, l.tw) or l.id
    if l.st == 'accepted' and l.s < committed then
      given[pair] = true
    end
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
redis.call('HSET', K_META, 'open', A.version, 'line', math.max(meta('line'), A.line or 0), 'opened_at', now)
-- A claim on a step of the old timeline must not hold the redone step of that index back.
redis.call('HDEL', K_META, 'claimed', 'claimed_at', 'claimed_by')
redis.call('HINCRBY', K_META, 'gen', 1)
return cjson.encode({retired = out})
