-- A committer takes the full step A.step from the queue (scheduler.committer): its leases, if it is still
-- the open step and still full (not committed meanwhile by a process that took over a lapsed claim).
-- The claim is renewed in this committer's name (A.name), so nobody takes the step over while it writes
-- the step and keeps saying it is alive.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local open = meta('open')
if open ~= A.step or num(redis.call('HGET', K_FILL, open)) < meta('target') then
  return cjson.encode({commit = false})
end
redis.call('HSET', K_META, 'claimed', open + 1, 'claimed_at', now, 'claimed_by', A.name or '')
return cjson.encode({commit = {step = open, leases = step_leases(open), line = meta('line')}})
