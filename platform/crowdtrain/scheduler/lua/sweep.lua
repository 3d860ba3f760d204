-- Periodic expiry for campaigns nobody is asking leases of, and whether a backup is due. A: limit, gone_s,
-- backup_min_s.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local out = {}
sweep(out, A.limit, A.gone_s)
-- A lease of the open step past its soft deadline waits for a device to ask: the site wakes a waiting
-- request for it rather than leave the step held until some request's wait runs out.
-- Entries that can no longer get a backup go, and leases ahead of the open step wait (as lease.lua does):
-- neither may hide a late lease of the open step behind them.
local backup_due = false
for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_SOFT, '-inf', now, 'LIMIT', 0, 16)) do
  local late = lease_get(id)
  if not late or late.st ~= 'active' or late.tw ~= 0 then
    redis.call('ZREM', K_SOFT, id)
  elseif late.s ~= meta('open') then
    redis.call('ZADD', K_SOFT, now + A.backup_min_s, id)
  else
    backup_due = true
  end
end
return cjson.encode({expired = out, commit = full_step() or false, backup_due = backup_due})
