-- Stamps every device of one site process's set (KEYS[2]) as seen at ARGV[1] in the presence set (KEYS[1]),
-- inside Redis: a process's batch sends only the devices that came and went, not all its connections.
-- The set lives ARGV[2] seconds past the last batch. Returns the set's size (the process checks it against
-- its own count, and sends the whole set again when Redis lost it). Standalone: no prelude.
local members = redis.call('SMEMBERS', KEYS[2])
for first = 1, #members, 1000 do
  local args = {}
  for i = first, math.min(first + 999, #members) do
    args[#args + 1] = ARGV[1]
    args[#args + 1] = members[i]
  end
  redis.call('ZADD', KEYS[1], unpack(args))
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return #members
