-- Take a waiting verification copy (crowdtrain.verification.checks.take_copy). Standalone: no prelude.
-- KEYS[1]: the campaign's queue of copies (a list of JSON entries, ``checks.CopyEntry``: c the check,
-- x volunteers who may never take it, u when it goes stale, v its base version, n its samples, r the role,
-- g its ranges, a the original volunteer's tags, w when a similar volunteer may take it, s 1 if one did);
-- KEYS[2]: lease id -> campaign marker (the hot state's "ct:lc").
-- ARGV: 1 now, 2 the volunteer, 3 how many entries to look through, 4 the oldest base version still served,
-- 5 the copy's lease id, 6 the campaign, 7 the device, 8 the volunteer's tags (a JSON list).
-- Looks through the first ARGV[3] waiting copies: drops those past their wait (stale) and those whose base
-- version aggregators no longer keep (gone), and takes the first one volunteer ARGV[2] may compute: never
-- their own (``x``), and one of a volunteer sharing a tag with them (ARGV[8], a JSON list; the original's
-- are ``a``) only after ``w``, marked similar. A copy taken is recorded at once as lease ARGV[5] of device
-- ARGV[7] in the lease-to-campaign map (KEYS[2]), with all its report needs (``copy_marker``); entries
-- written before 2.9 carry too little for that.
local raws = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
local now, me, chosen, stale, gone = tonumber(ARGV[1]), tonumber(ARGV[2]), false, {}, {}
local oldest = tonumber(ARGV[4])
local mytags = {}
for _, t in ipairs(cjson.decode(ARGV[8])) do mytags[t] = true end
for _, raw in ipairs(raws) do
  local e = cjson.decode(raw)
  if e.u < now then
    stale[#stale + 1] = e.c
    redis.call('LREM', KEYS[1], 1, raw)
  elseif e.v ~= nil and e.v < oldest then
    gone[#gone + 1] = e.c
    redis.call('LREM', KEYS[1], 1, raw)
  elseif not chosen then
    local mine, alike = false, false
    for _, v in ipairs(e.x) do if v == me then mine = true end end
    if e.a ~= nil then
      for _, t in ipairs(e.a) do if mytags[t] then alike = true end end
    end
    if not mine and not (alike and e.w ~= nil and now < e.w) then
      chosen = raw
      redis.call('LREM', KEYS[1], 1, raw)
      if e.n ~= nil and e.r ~= nil then
        redis.call('HSET', KEYS[2], ARGV[5],
          ARGV[6] .. ':check:' .. string.format('%d', e.c) .. ':' .. e.r .. ':' .. ARGV[2] .. ':' .. ARGV[7]
          .. ':' .. string.format('%d', e.n) .. (alike and ':1' or ''))
      end
      -- Marked by appending a key to the entry's text: re-encoding it would turn an empty list x into {}.
      if alike then chosen = string.sub(raw, 1, -2) .. ',"s":1}' end
    end
  end
end
return cjson.encode({chosen = chosen, stale = stale, gone = gone})
