-- Deletes a device's activity record (KEYS[1]) only if it is still the one this process wrote (ARGV[1]):
-- after a reconnect to another process, the newer connection's record stays. Standalone: no prelude.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
