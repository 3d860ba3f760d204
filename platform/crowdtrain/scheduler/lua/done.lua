-- Count a finished lease. A: id, device, n, loss, cs (compute seconds), problem (why the site refuses
-- its receipts or loss, '' when it does not), gen (the campaign generation the problem was judged at),
-- nu, nd, ns (what the lease cost the agent's link, bounded by the site: bytes up, 0 when not reported,
-- bytes down, seconds waited; crowdtrain.scheduler.network).
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local l = lease_get(A.id)
if not l or l.d ~= A.device then return cjson.encode({accepted = false, reason = 'unknown lease'}) end
if l.st == 'accepted' then return cjson.encode({accepted = false, reason = 'lease already reported'}) end
if l.st ~= 'active' then
  return cjson.encode({accepted = false, reason = 'lease ' .. l.st .. (l.why ~= '' and (': ' .. l.why) or '')})
end
local out = {}
redis.call('ZADD', SEEN, now, A.device) -- a device that asks or reports is alive
if A.gen ~= meta('gen') then
  -- The site process checked the receipts against an older copy of the campaign (its slices may
  -- have moved): it reads the campaign again and asks once more. Nothing changed here.
  return cjson.encode({gen = meta('gen')})
end
local open = meta('open')
if A.n ~= l.n then
  retire(l, 'rejected', 'lease has ' .. l.n .. ' samples, report says ' .. A.n, out)
  return cjson.encode({accepted = false, reason = out[1][3], retired = out})
end
if A.problem ~= '' then
  retire(l, 'rejected', A.problem, out)
  return cjson.encode({accepted = false, reason = A.problem, retired = out})
end
if l.s < open then
  retire(l, 'rejected', 'stale version: computed on ' .. l.b .. ', step ' .. open .. ' is open', out)
  return cjson.encode({accepted = false, reason = out[1][3], retired = out})
end
l.st, l.loss, l.t1 = 'accepted', A.loss, now
-- The agent's figure, kept within what is possible: it cannot have computed longer than it held the lease.
l.cs = math.min(math.max(A.cs, 0), math.max(now - l.t0, 0))
-- Kept for the step's commit (StepNetwork); the network waits too fit in the time the lease was held.
l.nu, l.nd = A.nu or 0, A.nd or 0
l.ns = math.min(math.max(A.ns or 0, 0), math.max(now - l.t0, 0))
redis.call('ZREM', K_DL, l.id)
redis.call('ZREM', K_SOFT, l.id)
unhold(l.d)
if l.tw ~= 0 then
  local twin = lease_get(l.tw)
  if twin and twin.st == 'active' then
    -- The samples are this lease's now: retiring the twin must not give them back.
    retire(twin, 'released', (l.bk == 1) and 'the backup lease finished first' or 'the original lease finished first',
      out, true)
  end
  l.tw = 0
end
lease_put(l)
redis.call('HINCRBY', K_FILL, l.s, l.n)
redis.call('ZADD', K_ACC, l.s, l.id)
-- What the site measured, not what the agent says: lease time for soft deadlines, speed for hard ones.
local took = math.max(now - l.t0, 1e-3)
local typical = meta('lease_s')
redis.call('HSET', K_META, 'lease_s', (typical > 0) and (0.8 * typical + 0.2 * took) or took)
local speed = num(redis.call('HGET', K_SPD, l.d))
local measured = l.n / took
redis.call('HSET', K_SPD, l.d, (speed > 0) and (0.7 * speed + 0.3 * measured) or measured)
return cjson.encode({accepted = true, step = l.s, lease = l, retired = out, gen = meta('gen'),
  commit = full_step(A.handoff, A.handoff_least) or false})
