-- Give one device a lease, or say why not. A: device, want, claimed (samples/s, 0 unknown),
-- id (a fresh lease id), cid, rid (the request's id, '' for none), min_dl, max_dl, idle_s, gone_s,
-- backup_min_s, backup_factor, backups (0: issue none now), sweep, owner (the device's volunteer),
-- cap (the most leases of one step that volunteer may hold, 0 for no limit: verification.standing.probation),
-- relief_s (for every relief_s in which the open step took no lease while it held leases of two or more capped
-- volunteers, their cap in it grows by itself, up to RELIEF_MAX times, so a campaign with fewer volunteers than
-- leases per step still commits; 0: never).
if redis.call('EXISTS', K_META) == 0 then return cjson.encode({missing = true}) end
local out = {}
redis.call('ZADD', SEEN, now, A.device) -- a device that asks or reports is alive
sweep(out, A.sweep, A.gone_s)
local gen = meta('gen')
local function refuse(code, extra)
  local r = {kind = 'refuse', code = code, expired = out, gen = gen}
  for k, v in pairs(extra or {}) do r[k] = v end
  return cjson.encode(r)
end
if meta('run') ~= 1 then
  return refuse('paused', {why = redis.call('HGET', K_META, 'why') or ''})
end

local device = A.device
local owner, cap = num(A.owner), num(A.cap)
local open, target, stale, max_steps = meta('open'), meta('target'), meta('stale'), meta('max')
local opened = tonumber(redis.call('HGET', K_META, 'opened_at'))
if not opened then
  opened = now
  redis.call('HSET', K_META, 'opened_at', now)
end
-- One account alone never fills a step; several newcomers who are all there is may, once nobody else came:
-- their cap in the open step grows by itself for every relief_s in which the campaign issued no lease.
local RELIEF_MAX = 3
local relief = 0
if cap > 0 and num(A.relief_s) > 0 and redis.call('HLEN', share_key(open)) >= 2 then
  local quiet = now - math.max(opened, num(redis.call('HGET', K_META, 'issued_at')))
  relief = math.min(RELIEF_MAX, math.floor(quiet / num(A.relief_s)))
end
local function at_cap(s)
  local limit = (s == open) and cap * (1 + relief) or cap
  return cap > 0 and num(redis.call('HGET', share_key(s), owner)) >= limit
end
local held = num(redis.call('HGET', K_HOLD, device))
redis.call('ZREMRANGEBYSCORE', K_IDLE, '-inf', now - A.idle_s)
if held == 0 then redis.call('ZADD', K_IDLE, now, device) end

local function deadline_for(n)
  -- Measured speed when the site has seen this device work, its claim until then.
  local speed = num(redis.call('HGET', K_SPD, device))
  if speed <= 0 then speed = A.claimed end
  local seconds = A.min_dl
  if speed > 0 then seconds = math.max(seconds, 3 * n / speed) end
  return now + math.min(seconds, math.max(A.max_dl, A.min_dl))
end

local function issue(l)
  l.id, l.d, l.b, l.t0, l.st, l.dl = A.id, device, open, now, 'active', deadline_for(l.n)
  l.loss, l.cs, l.why, l.t1 = 0, 0, '', 0
  l.o = (cap > 0) and owner or 0
  if l.o ~= 0 then
    redis.call('HINCRBY', share_key(l.s), owner, 1)
  end
  lease_put(l)
  redis.call('HSET', K_META, 'issued_at', now)
  redis.call('HSET', LC, l.id, A.cid)
  if A.rid ~= '' then redis.call('HSET', RID, device, A.cid .. ':' .. l.id .. ':' .. A.rid) end
  redis.call('ZADD', K_DL, l.dl, l.id)
  redis.call('HINCRBY', K_HOLD, device, 1)
  redis.call('ZREM', K_IDLE, device)
  return cjson.encode({kind = 'lease', lease = l, expired = out, gen = gen,
    epoch = meta('epoch'), cursor = meta('cursor')})
end

-- How long n samples take this device, issue to report, as the site measured it (download, compute and
-- upload alike); a device it has not seen finish a lease is taken for the swarm's typical lease. 0: unknown.
local function expected_s(d, n)
  local speed = num(redis.call('HGET', K_SPD, d))
  if speed > 0 then return n / speed end
  return meta('lease_s')
end

-- A lease past its soft deadline holds its step back: its samples go to this device too, and
-- the first valid report wins (MapReduce's backup tasks). Only a lease of the open step holds a
-- commit back, and a site that is behind (A.backups == 0) issues none: its own backlog is what
-- makes leases late then, and a backup would only duplicate work. Every backup that loses
-- throws its upload away, so one is issued only where it can win: to a device expected to finish
-- the whole lease sooner than the original has already taken.
for _, id in ipairs(A.backups == 1 and redis.call('ZRANGEBYSCORE', K_SOFT, '-inf', now, 'LIMIT', 0, 16) or {}) do
  local slow = lease_get(id)
  if not slow or slow.st ~= 'active' or slow.tw ~= 0 then
    redis.call('ZREM', K_SOFT, id)
  elseif slow.s ~= open then
    redis.call('ZADD', K_SOFT, now + A.backup_min_s, id) -- not holding a commit back yet: look again later
  elseif slow.d ~= device and not at_cap(slow.s) and expected_s(device, slow.n) < now - slow.t0 then
    redis.call('ZREM', K_SOFT, id)
    slow.tw = A.id
    lease_put(slow)
    return issue({s = slow.s, n = slow.n, r = slow.r, tw = slow.id, bk = 1})
  end
end

-- The first step of the window with samples left that this volunteer may still hold a lease of.
local step, capped = open, false
while step <= open + stale do
  local full = num(redis.call('HGET', K_RES, step)) >= target
  if not full and not at_cap(step) then break end
  capped = capped or not full
  step = step + 1
end
if capped and (step > open + stale or (max_steps >= 0 and step >= max_steps)) then
  -- Room is left only where this volunteer is at the cap: the next commit may make room for them.
  return refuse('probation', {ready_at = open + 1, cap = cap})
end
if max_steps >= 0 and step >= max_steps then return refuse('last_step', {max = max_steps}) end
local hold = num(redis.call('HGET', K_META, 'hold') or -1)
if hold >= 0 and step >= hold then
  -- Its checkpoints lag too far behind (scheduler.durability): no work for a step that may not commit.
  return refuse('paused', {why = redis.call('HGET', K_META, 'hold_why') or ''})
end
if step > open + stale then return refuse('window_full', {step = open, ready_at = step - stale}) end
if held > 0 and redis.call('ZCARD', K_IDLE) > 0 then
  -- This device asks ahead while another waits with nothing to do: the other goes first.
  return refuse('idle_first', {ready_at = open + 1})
end

-- Samples: the redo queue first, then the epoch cursor.
local n = math.min(A.want, target - num(redis.call('HGET', K_RES, step)))
local count, ranges = n, {}
while count > 0 do
  local head = redis.call('LINDEX', K_RET, 0)
  if not head then break end
  local e, s, c = string.match(head, '^(%d+):(%d+):(%d+)$')
  e, s, c = tonumber(e), tonumber(s), tonumber(c)
  local k = math.min(c, count)
  ranges[#ranges + 1] = {e, s, k}
  if k == c then redis.call('LPOP', K_RET) else redis.call('LSET', K_RET, 0, e .. ':' .. (s + k) .. ':' .. (c - k)) end
  count = count - k
end
local cursor, epoch, total = meta('cursor'), meta('epoch'), meta('total')
while count > 0 do
  if cursor >= total then epoch, cursor = epoch + 1, 0 end
  local k = math.min(count, total - cursor)
  local last = ranges[#ranges]
  if last and last[1] == epoch and last[2] + last[3] == cursor then last[3] = last[3] + k
  else ranges[#ranges + 1] = {epoch, cursor, k} end
  cursor, count = cursor + k, count - k
end
redis.call('HSET', K_META, 'cursor', cursor, 'epoch', epoch)
redis.call('HINCRBY', K_RES, step, n)
-- Overdue means late against what this device (or, new, the swarm) has shown; with no history at all,
-- only the hard deadline, which no device's claim can stretch past its cap, makes it overdue.
local expected = expected_s(device, n)
local soft = deadline_for(n)
if expected > 0 then soft = math.min(soft, now + math.max(A.backup_min_s, A.backup_factor * expected)) end
redis.call('ZADD', K_SOFT, soft, A.id)
return issue({s = step, n = n, r = ranges, tw = 0, bk = 0})
