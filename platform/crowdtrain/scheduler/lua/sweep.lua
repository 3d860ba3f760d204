-- Periodic expiry for campaigns nobody is asking leases of. A: limit, gone_s.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local out = {}
sweep(out, A.limit, A.gone_s)
return cjson.encode({expired = out, commit = full_step() or false})
