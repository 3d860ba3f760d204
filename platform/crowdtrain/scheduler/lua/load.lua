-- Rebuild a campaign's hot state from the database's record (first use, or Redis lost it).
-- A: cid, meta (field -> value), leases (live lease records, o: the volunteer of a lease on probation),
-- ret (global ranges to redo), force, backup_min_s.
if redis.call('EXISTS', K_META) == 1 and not A.force then return cjson.encode({loaded = false}) end
forget_shares(meta('open'), meta('open') + meta('stale'))
redis.call('DEL', K_META, K_LEASES, K_RET, K_DL, K_SOFT, K_RES, K_FILL, K_ACC, K_HOLD, K_IDLE, K_TOMB, K_WAIT)
for k, v in pairs(A.meta) do redis.call('HSET', K_META, k, v) end
for _, r in ipairs(A.ret) do redis.call('RPUSH', K_RET, r[1] .. ':' .. r[2] .. ':' .. r[3]) end
for _, l in ipairs(A.leases) do
  lease_put(l)
  redis.call('HSET', LC, l.id, A.cid)
  if l.st == 'active' then
    redis.call('ZADD', K_DL, l.dl, l.id)
    redis.call('ZADD', K_SOFT, now + A.backup_min_s, l.id)
    redis.call('HINCRBY', K_HOLD, l.d, 1)
  else
    redis.call('HINCRBY', K_FILL, l.s, l.n)
    redis.call('ZADD', K_ACC, l.s, l.id)
  end
  redis.call('HINCRBY', K_RES, l.s, l.n)
  if (l.o or 0) ~= 0 then
    redis.call('HINCRBY', share_key(l.s), l.o, 1)
  end
end
return cjson.encode({loaded = true})
