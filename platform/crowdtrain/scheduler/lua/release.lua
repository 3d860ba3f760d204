-- An agent gives a lease back unfinished (it is shutting down, or lost its connection). A: id, device, reason.
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local l = lease_get(A.id)
local out = {}
if l and l.d == A.device and l.st == 'active' then retire(l, 'released', A.reason, out) end
return cjson.encode({retired = out})
