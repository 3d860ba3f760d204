-- Whether the campaign may lease now, and why not; bumps the generation so every site process
-- reloads its cached copy of the campaign. A: run (0/1), why, fields (other meta to set).
-- With A.quiet only the fields are set and the generation stays (the checkpoint hold: no cached copy reads it).
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
for k, v in pairs(A.fields) do redis.call('HSET', K_META, k, v) end
if A.quiet then return cjson.encode({gen = meta('gen')}) end
redis.call('HSET', K_META, 'run', A.run, 'why', A.why)
return cjson.encode({gen = redis.call('HINCRBY', K_META, 'gen', 1)})
