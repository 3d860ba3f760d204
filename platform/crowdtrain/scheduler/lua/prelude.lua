-- Shared by every scheduler script; each script is this prelude followed by its body.
-- KEYS[1]: the campaign's key prefix ("ct:{c42}:"); KEYS[2]: the presence set ("ct:seen");
-- KEYS[3]: lease id -> campaign id for every lease still remembered ("ct:lc");
-- KEYS[4]: device -> "campaign:lease:request id" of its newest lease ("ct:rid"), to answer a resent request.
-- KEYS[5]: full steps handed to the committers ("ct:commits", a list of "campaign:step"; scheduler.committer).
-- KEYS[6]: the running committers, scored by when each last said it was alive ("ct:committer").
-- ARGV[1]: now (seconds since the epoch, a float); ARGV[2]: a JSON object of the script's arguments.
-- Every script returns one JSON object. Lease records and ranges never hold nulls (0 means none):
-- cjson turns JSON null into a userdata that compares unequal to nil.
local P = KEYS[1]
local SEEN = KEYS[2]
local LC = KEYS[3]
local RID = KEYS[4]
local COMMITS = KEYS[5]
local COMMITTERS = KEYS[6]
local now = tonumber(ARGV[1])
local A = cjson.decode(ARGV[2])

local K_META, K_LEASES, K_RET = P .. 'meta', P .. 'leases', P .. 'ret'
local K_DL, K_SOFT, K_RES, K_FILL = P .. 'dl', P .. 'soft', P .. 'res', P .. 'fill'
local K_ACC, K_HOLD, K_IDLE, K_SPD = P .. 'acc', P .. 'hold', P .. 'idle', P .. 'spd'
local K_TOMB, K_WAIT = P .. 'tomb', P .. 'wait'
local TOMBSTONES = 2000 -- finished leases remembered, so a late or replayed report gets a true reason

local function num(x) return tonumber(x) or 0 end
local function meta(field) return num(redis.call('HGET', K_META, field)) end

local function lease_get(id)
  local raw = redis.call('HGET', K_LEASES, id)
  if not raw then return nil end
  return cjson.decode(raw)
end
local function lease_put(l) redis.call('HSET', K_LEASES, l.id, cjson.encode(l)) end

local function tomb(id)
  redis.call('RPUSH', K_TOMB, id)
  if redis.call('LLEN', K_TOMB) > TOMBSTONES then
    local old = redis.call('LPOP', K_TOMB)
    local l = lease_get(old)
    if l and l.st ~= 'active' and l.st ~= 'accepted' then
      redis.call('HDEL', K_LEASES, old)
      redis.call('HDEL', LC, old)
    end
  end
end

-- Probation (verification.standing.probation): per step, a hash of volunteer -> leases of the step
-- they hold, active or accepted, for volunteers whose leases were issued under a cap (a lease's o: its
-- volunteer, 0 when uncapped). Dropped when the step commits, and cleared by a rollback or a rebuild. No
-- TTL: a step paused for a day still holds its leases, and a count must not vanish under them.
local function share_key(s) return P .. 'share:' .. s end
local function unshare(l)
  if (l.o or 0) ~= 0 and redis.call('HINCRBY', share_key(l.s), l.o, -1) <= 0 then
    redis.call('HDEL', share_key(l.s), l.o)
  end
end
local function forget_shares(from, to)
  for s = from, to do redis.call('DEL', share_key(s)) end
end

local function unhold(device)
  if redis.call('HINCRBY', K_HOLD, device, -1) <= 0 then redis.call('HDEL', K_HOLD, device) end
end

-- Samples go back to the redo queue, served before the cursor moves on.
local function give_back(l)
  for _, r in ipairs(l.r) do redis.call('RPUSH', K_RET, r[1] .. ':' .. r[2] .. ':' .. r[3]) end
  redis.call('HINCRBY', K_RES, l.s, -l.n)
end

-- End an active lease without counting it. A lease and its backup share one set of samples:
-- the samples go back only when the last of the pair ends unaccepted (``keep``: its twin was accepted).
local function retire(l, state, reason, out, keep)
  l.st, l.why, l.t1 = state, reason, now
  redis.call('ZREM', K_DL, l.id)
  redis.call('ZREM', K_SOFT, l.id)
  unhold(l.d)
  unshare(l)
  local twin = (l.tw ~= 0) and lease_get(l.tw) or nil
  if keep then
    -- the accepted twin holds the samples
  elseif twin and twin.st == 'active' then
    twin.tw = 0
    lease_put(twin)
    if twin.bk == 0 then
      -- The original outlived its backup: it may be backed up again.
      redis.call('ZADD', K_SOFT, now, twin.id)
    end
  else
    give_back(l)
  end
  l.tw = 0
  lease_put(l)
  tomb(l.id)
  out[#out + 1] = {l.id, state, reason}
end

-- Leases past their deadline whose agents are gone. An agent that is still connected keeps
-- its lease however late: its upload may be done and its report queued behind a busy site,
-- and a backup lease (see lease.lua) keeps the step moving meanwhile.
local function sweep(out, limit, gone_s)
  local ids = redis.call('ZRANGEBYSCORE', K_DL, '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(ids) do
    local l = lease_get(id)
    if not l or l.st ~= 'active' then
      redis.call('ZREM', K_DL, id)
    elseif num(redis.call('ZSCORE', SEEN, l.d)) >= now - gone_s then
      redis.call('ZADD', K_DL, now + gone_s, id)
    else
      retire(l, 'expired', 'deadline passed', out)
    end
  end
end

-- The accepted leases of step s, in lease-id order: what its commit writes.
local function step_leases(s)
  local ids = redis.call('ZRANGEBYSCORE', K_ACC, s, s)
  local leases = {}
  for _, id in ipairs(ids) do leases[#leases + 1] = lease_get(id) end
  table.sort(leases, function(a, b) return a.id < b.id end)
  return leases
end

-- Whether the claim on a step is held by committers that are gone. ``by``: '' for a site process (its
-- liveness is not known here: only COMMIT_CLAIM_S ends its claim), '*' for the committers' queue (gone
-- when none is alive), or the name of the committer that took the step (take.lua). ``alive_since``: the
-- caller's A.alive_since, the time before which a committer's last word means it is gone (nil: unknown).
local function claimer_gone(by, alive_since)
  if not alive_since or by == '' then return false end
  if by == '*' then return redis.call('ZCOUNT', COMMITTERS, alive_since, '+inf') == 0 end
  return num(redis.call('ZSCORE', COMMITTERS, by)) < alive_since
end

-- The accepted leases of the open step when it holds the whole global batch, in lease-id order:
-- handed to one caller, which writes the step to the database. Others asking meanwhile get nothing,
-- unless that caller has not finished after COMMIT_CLAIM_S (it died), or the committers that hold the
-- claim have stopped saying they are alive: then the next one takes over.
-- With ``handoff`` (the campaign's id, 0 for none) a step of at least ``least`` leases goes to the
-- committers' queue instead, and the caller is told only that it was queued: a committer takes it
-- (take.lua) and writes it.
-- The campaign's timeline ('line', its rollbacks so far, as the database counts them) goes with the leases:
-- the database takes the step only if no rollback came since (scheduler.commits). A step at or past 'hold'
-- (the newest complete checkpoint plus the lag the site allows, -1: none) waits for checkpoints to catch up.
local COMMIT_CLAIM_S = 10
local function full_step(handoff, least)
  local open = meta('open')
  local target = meta('target')
  if num(redis.call('HGET', K_FILL, open)) < target then return nil end
  local hold = num(redis.call('HGET', K_META, 'hold') or -1)
  if hold >= 0 and open >= hold then return nil end
  local claim = redis.call('HMGET', K_META, 'claimed', 'claimed_at', 'claimed_by')
  if num(claim[1]) == open + 1 and now - num(claim[2]) < COMMIT_CLAIM_S
      and not claimer_gone(claim[3] or '', A.alive_since) then
    return nil
  end
  if (handoff or 0) ~= 0 and redis.call('ZCOUNT', K_ACC, open, open) >= (least or 0) then
    redis.call('HSET', K_META, 'claimed', open + 1, 'claimed_at', now, 'claimed_by', '*')
    redis.call('RPUSH', COMMITS, handoff .. ':' .. open)
    return {step = open, queued = true}
  end
  redis.call('HSET', K_META, 'claimed', open + 1, 'claimed_at', now, 'claimed_by', '')
  return {step = open, leases = step_leases(open), line = meta('line')}
end
