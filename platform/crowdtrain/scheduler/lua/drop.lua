-- Leave a quarantined volunteer's work out of every step. A: devices (ids), reason. Their accepted
-- leases that no step has committed and their active leases end as rejected, and the samples go back
-- to the redo queue for other volunteers. A step already handed to a process to commit keeps its leases
-- (the database has them, or is writing them); the site withholds their credit instead.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local devices, out = {}, {}
for _, d in ipairs(A.devices) do devices[d] = true end
local open = meta('open')
local claimed = meta('claimed') == open + 1
for _, id in ipairs(redis.call('ZRANGE', K_ACC, 0, -1)) do
  local l = lease_get(id)
  if l and devices[l.d] and not (claimed and l.s == open) then
    redis.call('ZREM', K_ACC, id)
    redis.call('HINCRBY', K_FILL, l.s, -l.n)
    give_back(l)
    unshare(l)
    l.st, l.why, l.t1 = 'rejected', A.reason, now
    lease_put(l)
    tomb(l.id)
    out[#out + 1] = {l.id, 'rejected', A.reason}
  end
end
for _, id in ipairs(redis.call('ZRANGE', K_DL, 0, -1)) do
  local l = lease_get(id)
  if l and l.st == 'active' and devices[l.d] then retire(l, 'rejected', A.reason, out) end
end
return cjson.encode({retired = out})
