-- Lockgate's rate and quota limiter on Redis: one script, run by EVALSHA from
-- tenancy/limiter/redis.py (whose docstring gives the key layout), ARGV[1] naming the
-- operation: acquire, reserve, settle, cancel, heartbeat, expired, usage, register, tags and
-- prune (the registry of tags), or rebuild, peek and replayed (the tag's epoch: budgets rebuilt
-- from the usage rows, rows replayed from a spool). Each runs atomically and reads the
-- time from Redis's own clock.
--
-- KEYS layout for acquire, reserve, settle and cancel: [marker, then per limited scope: win,
-- tok, lease, day, month, then the pending index: pending, info, res, then the tag's epoch
-- and the request's refund description], all of one hash tag (the request's), so that on Redis Cluster they are in one slot.
--
-- The epoch (`H:time:nonce`, H the highest usage row id the rebuild counted) exists once the
-- tag's day and month counters were rebuilt from the usage rows; a tag without one (Redis
-- restarted empty, a Cluster node lost its slots) answers 'rebuild' to every admission and
-- settlement until the caller rebuilds it. An admission carries the epoch it was made in: one
-- from before the current epoch is 'stale' (its reservation is in no counter).
-- Per-scope limits in ARGV: rpm, tpm, conc, day, month (-1 = unlimited). Times are integer
-- microseconds (TIME), passed to Redis commands through fmt() so large numbers are never
-- written in exponent notation.
--
-- The pending index lets a reconciler find admissions whose process died: `pending` (sorted
-- set: request id -> lease expiry, renewed by heartbeats), `info` (hash: request id -> the
-- lease's description, written by the caller at acquire) and `res` (hash: request id -> its
-- reserved tokens). Settle and cancel remove a request from all three.
-- Markers: '1' unsettled; '0' a cancelled request's tombstone; 'r' an admission the reconciler
-- abandoned (its reservation refunded): a late settle of it charges its used tokens in full,
-- a replayed row of it (`replayed`) too; 's' a stale admission settled, or a refunded one
-- charged: nothing more to charge. 'r' and 's' last the refund's lifetime (days), and an 'r'
-- comes with `P{T}:refund:<id>`, the lease's description (its scopes, day and month).

local op = ARGV[1]

local function fmt(x) return string.format('%d', x) end

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Drop window entries admitted at or before cutoff, and their tokens from the sum.
local function trim_window(win, tok, cutoff)
  local old = redis.call('ZRANGEBYSCORE', win, '-inf', fmt(cutoff))
  if #old == 0 then return end
  local freed = 0
  for i = 1, #old do
    local v = redis.call('HGET', tok, old[i])
    if v then
      freed = freed + tonumber(v)
      redis.call('HDEL', tok, old[i])
    end
  end
  redis.call('ZREMRANGEBYSCORE', win, '-inf', fmt(cutoff))
  if freed ~= 0 then redis.call('HINCRBY', tok, '', fmt(-freed)) end
end

-- Time until fewer than `limit` entries are in the window, `count` being in it now (the
-- request just admitted, if any, is the newest).
local function requests_wait(win, count, limit, now, window)
  if count < limit then return 0 end
  local idx = count - limit
  local e = redis.call('ZRANGE', win, idx, idx, 'WITHSCORES')
  if #e == 0 then return window end
  return tonumber(e[2]) + window - now
end

-- Time until the window's tokens drop from `total` to `target` or below, oldest leaving first.
local function tokens_wait(win, tok, total, target, now, window)
  if total <= target then return 0 end
  local start = 0
  while true do
    local page = redis.call('ZRANGE', win, start, start + 127, 'WITHSCORES')
    if #page == 0 then return window end
    for j = 1, #page, 2 do
      total = total - (tonumber(redis.call('HGET', tok, page[j])) or 0)
      if total <= target then return tonumber(page[j + 1]) + window - now end
    end
    start = start + 128
  end
end

local function limits(base)
  return tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]),
         tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
end

-- The rate-limit header values of every scope: {scope index, kind (0 requests, 1 tokens),
-- limit, remaining, reset}, the window holding counts[i] + dcount requests and sums[i] + dsum
-- tokens.
local function header_rows(n, base, counts, sums, dcount, dsum, now, window)
  local headers = {}
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm = limits(base + (i - 1) * 5)
    local count, sum = counts[i] + dcount, sums[i] + dsum
    if rpm >= 0 then
      local reset = -1
      if rpm > 0 then reset = requests_wait(KEYS[k + 1], count, rpm, now, window) end
      headers[#headers + 1] = {i - 1, 0, rpm, math.max(0, rpm - count), reset}
    end
    if tpm >= 0 then
      local reset = -1
      if tpm > 0 then reset = tokens_wait(KEYS[k + 1], KEYS[k + 2], sum, tpm - 1, now, window) end
      headers[#headers + 1] = {i - 1, 1, tpm, math.max(0, tpm - sum), reset}
    end
  end
  return headers
end

-- The start of settle and cancel: consume rid's marker, drop its concurrency leases and its
-- pending entry. Returns the marker: '1' (unsettled), 'r' (abandoned by the reconciler) or
-- false (gone, or a tombstone: nothing more to adjust).
local function finish(rid, n, base)
  local marker = redis.call('GET', KEYS[1])
  local live = (marker == '1' or marker == 'r') and marker or false
  if live then redis.call('DEL', KEYS[1]) end
  for i = 1, n do
    local _, _, conc = limits(base + (i - 1) * 5)
    if conc >= 0 then redis.call('ZREM', KEYS[1 + (i - 1) * 5 + 3], rid) end
  end
  local p = 1 + n * 5
  -- what the admission holds on the budgets, as Redis recorded it (a caller's lease may be
  -- stale: a reserve whose reply was lost); nil when it is not in the index
  local held = tonumber(redis.call('HGET', KEYS[p + 3], rid))
  redis.call('ZREM', KEYS[p + 1], rid)
  redis.call('HDEL', KEYS[p + 2], rid)
  redis.call('HDEL', KEYS[p + 3], rid)
  return live, held
end

-- The reconciler refunded an admission: its marker 'r' and its lease's description (`info`,
-- read from the pending index before `finish` dropped it) kept for `refund_ms`.
local function refunded(info, refund_ms)
  redis.call('SET', KEYS[1], 'r', 'PX', refund_ms)
  if info then redis.call('SET', KEYS[#KEYS], info, 'PX', refund_ms) end
end

-- The end of an admission from before the current epoch (mode 'settle', 'abandon' or
-- 'cancel'): it holds nothing on any counter. A settle charges its used tokens unless the
-- rebuild counted its row, which the caller finds out from the database: without that
-- finding against the current epoch the answer is {'stale', epoch} and nothing changes.
-- Ends with the marker 's' (or 'r' for an abandon: a row replayed later is charged), so that
-- the end is charged once. Returns 0 if it had ended already.
local function stale_end(rid, n, base, used, mode, epoch, finding, against, refund_ms)
  local m = redis.call('GET', KEYS[1])
  if m == '0' or m == 's' then
    finish(rid, n, base)
    return 0
  end
  if mode == 'settle' and (against ~= epoch or (finding ~= 'counted' and finding ~= 'charge')) then
    return {'stale', epoch}
  end
  local info = redis.call('HGET', KEYS[1 + n * 5 + 2], rid)
  finish(rid, n, base)
  if mode == 'abandon' then
    refunded(info, refund_ms)
    return 1
  end
  if finding == 'charge' and used > 0 then
    for i = 1, n do
      local k = 1 + (i - 1) * 5
      for _, key in ipairs({KEYS[k + 4], KEYS[k + 5]}) do
        if redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, fmt(used)) end
      end
    end
  end
  redis.call('SET', KEYS[1], 's', 'PX', refund_ms)
  return 1
end

-- A budget counter's refusal of `tokens` more, or nil: {scope index, field, wait, used}.
local function budget_refusal(i, field, key, budget, tokens, period_end, now)
  if budget < 0 then return nil end
  local used = tonumber(redis.call('GET', key) or '0')
  if used + tokens <= budget then return nil end
  local wait = -1
  if tokens <= budget then wait = period_end - now end
  return {i - 1, field, wait, used}
end

if op == 'acquire' then
  local rid = ARGV[2]
  local tokens = tonumber(ARGV[3])
  local window = tonumber(ARGV[4])
  local ttl = tonumber(ARGV[5])
  local pending_ms = ARGV[6]
  local day_start, day_end = tonumber(ARGV[7]), tonumber(ARGV[8])
  local day_expire_ms = ARGV[9]
  local month_start, month_end = tonumber(ARGV[10]), tonumber(ARGV[11])
  local month_expire_ms = ARGV[12]
  local n = tonumber(ARGV[13])
  local now = clock()
  if now < day_start or now >= day_end or now < month_start or now >= month_end then
    return {'clock', now}
  end
  local epoch = redis.call('GET', KEYS[#KEYS - 1])
  if not epoch then return {'rebuild', now} end
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'duplicate', now} end

  local refusals, counts, sums = {}, {}, {}
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(13 + (i - 1) * 5)
    local count, sum = 0, 0
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      -- request ids are unique: one still in the window cannot be admitted again
      if redis.call('ZSCORE', KEYS[k + 1], rid) then return {'duplicate', now} end
      count = redis.call('ZCARD', KEYS[k + 1])
      sum = tonumber(redis.call('HGET', KEYS[k + 2], '') or '0')
    end
    counts[i], sums[i] = count, sum
    if rpm >= 0 and count + 1 > rpm then
      local wait = -1
      if rpm > 0 then wait = requests_wait(KEYS[k + 1], count, rpm, now, window) end
      refusals[#refusals + 1] = {i - 1, 0, wait, count}
    end
    if tpm >= 0 and sum + tokens > tpm then
      local wait = -1
      if tokens <= tpm then
        wait = tokens_wait(KEYS[k + 1], KEYS[k + 2], sum, tpm - tokens, now, window)
      end
      refusals[#refusals + 1] = {i - 1, 1, wait, sum}
    end
    if conc >= 0 then
      redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', fmt(now))
      local c = redis.call('ZCARD', KEYS[k + 3])
      if c + 1 > conc then
        local wait = -1
        if conc > 0 then
          local first = redis.call('ZRANGE', KEYS[k + 3], 0, 0, 'WITHSCORES')
          wait = tonumber(first[2]) - now
        end
        refusals[#refusals + 1] = {i - 1, 2, wait, c}
      end
    end
    local r = budget_refusal(i, 3, KEYS[k + 4], dayb, tokens, day_end, now)
    if r then refusals[#refusals + 1] = r end
    r = budget_refusal(i, 4, KEYS[k + 5], monthb, tokens, month_end, now)
    if r then refusals[#refusals + 1] = r end
  end

  local admitted = #refusals == 0
  if admitted then
    local window_ms = fmt(window / 1000 + 1000)
    local lease_ms = fmt(ttl / 1000 + 1000)
    for i = 1, n do
      local k = 1 + (i - 1) * 5
      local rpm, tpm, conc, dayb, monthb = limits(13 + (i - 1) * 5)
      if rpm >= 0 or tpm >= 0 then
        redis.call('ZADD', KEYS[k + 1], fmt(now), rid)
        redis.call('HSET', KEYS[k + 2], rid, ARGV[3])
        redis.call('HINCRBY', KEYS[k + 2], '', ARGV[3])
        redis.call('PEXPIRE', KEYS[k + 1], window_ms)
        redis.call('PEXPIRE', KEYS[k + 2], window_ms)
      end
      if conc >= 0 then
        redis.call('ZADD', KEYS[k + 3], fmt(now + ttl), rid)
        redis.call('PEXPIRE', KEYS[k + 3], lease_ms)
      end
      if dayb >= 0 then
        redis.call('INCRBY', KEYS[k + 4], ARGV[3])
        redis.call('PEXPIREAT', KEYS[k + 4], day_expire_ms)
      end
      if monthb >= 0 then
        redis.call('INCRBY', KEYS[k + 5], ARGV[3])
        redis.call('PEXPIREAT', KEYS[k + 5], month_expire_ms)
      end
    end
    redis.call('SET', KEYS[1], '1', 'PX', pending_ms)
    local p = 1 + n * 5
    redis.call('ZADD', KEYS[p + 1], fmt(now + ttl), rid)
    redis.call('HSET', KEYS[p + 2], rid, ARGV[14 + n * 5] .. '|' .. epoch)
    redis.call('HSET', KEYS[p + 3], rid, ARGV[3])
  end

  local headers
  if admitted then
    headers = header_rows(n, 13, counts, sums, 1, tokens, now, window)
  else
    headers = header_rows(n, 13, counts, sums, 0, 0, now, window)
  end
  if admitted then return {'ok', now, refusals, headers, epoch} end
  return {'refused', now, refusals, headers}

elseif op == 'reserve' then
  -- ARGV: rid, tokens, window, day end, month end, n, the limits of each scope, then the
  -- lease's epoch. Adds `tokens` to an unsettled admission's reservation if every
  -- tokens-per-minute and budget limit has room; otherwise changes nothing. An admission from
  -- before the current epoch is gone (what it held is in no counter).
  local rid, tokens, window = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local day_end, month_end = tonumber(ARGV[5]), tonumber(ARGV[6])
  local n = tonumber(ARGV[7])
  local now = clock()
  local epoch = redis.call('GET', KEYS[#KEYS - 1])
  if not epoch then return {'rebuild', now} end
  local of = ARGV[8 + n * 5]
  if of ~= '' and of ~= epoch then return {'gone', now} end
  if redis.call('GET', KEYS[1]) ~= '1' then return {'gone', now} end
  local refusals, counts, sums = {}, {}, {}
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, _, dayb, monthb = limits(7 + (i - 1) * 5)
    local count, sum = 0, 0
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      count = redis.call('ZCARD', KEYS[k + 1])
      sum = tonumber(redis.call('HGET', KEYS[k + 2], '') or '0')
    end
    counts[i], sums[i] = count, sum
    if tpm >= 0 and sum + tokens > tpm then
      local wait = -1
      if tokens <= tpm then
        wait = tokens_wait(KEYS[k + 1], KEYS[k + 2], sum, tpm - tokens, now, window)
      end
      refusals[#refusals + 1] = {i - 1, 1, wait, sum}
    end
    local r = budget_refusal(i, 3, KEYS[k + 4], dayb, tokens, day_end, now)
    if r then refusals[#refusals + 1] = r end
    r = budget_refusal(i, 4, KEYS[k + 5], monthb, tokens, month_end, now)
    if r then refusals[#refusals + 1] = r end
  end
  if #refusals > 0 then
    return {'refused', now, refusals, header_rows(n, 7, counts, sums, 0, 0, now, window)}
  end
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, _, dayb, monthb = limits(7 + (i - 1) * 5)
    if (rpm >= 0 or tpm >= 0) and redis.call('ZSCORE', KEYS[k + 1], rid) then
      redis.call('HINCRBY', KEYS[k + 2], rid, ARGV[3])
      redis.call('HINCRBY', KEYS[k + 2], '', ARGV[3])
    end
    -- acquire made both counters (with their expiry) in this admission's periods
    if dayb >= 0 and redis.call('EXISTS', KEYS[k + 4]) == 1 then
      redis.call('INCRBY', KEYS[k + 4], ARGV[3])
    end
    if monthb >= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
      redis.call('INCRBY', KEYS[k + 5], ARGV[3])
    end
  end
  redis.call('HINCRBY', KEYS[1 + n * 5 + 3], rid, ARGV[3])
  return {'ok', now, refusals, header_rows(n, 7, counts, sums, 0, tokens, now, window)}

elseif op == 'settle' then
  -- ARGV: rid, used, reserved, window, n, the limits of each scope, then the mode: 'settle',
  -- or 'abandon' (the reconciler: only if the pending entry expired; used is 0; the marker
  -- becomes 'r' so that a late settle, or a replayed row, charges what it used), the marker's
  -- lifetime (ms), the lease's epoch, and for a stale admission the caller's finding about
  -- its row ('counted': the rebuild counted it; 'charge': it did not), the epoch that finding
  -- is against, the lifetime of an 'r' or 's' marker (ms), and optionally the tokens the
  -- budgets count (cached prompt tokens priced lower; else used).
  local rid = ARGV[2]
  local used = tonumber(ARGV[3])
  local window = tonumber(ARGV[5])
  local n = tonumber(ARGV[6])
  local mode, pending_ms = ARGV[7 + n * 5], ARGV[8 + n * 5]
  local of, finding, against = ARGV[9 + n * 5], ARGV[10 + n * 5], ARGV[11 + n * 5]
  local refund_ms = ARGV[12 + n * 5]
  local budget_used = tonumber(ARGV[13 + n * 5] or ARGV[3])
  local epoch = redis.call('GET', KEYS[#KEYS - 1])
  if not epoch then return {'rebuild'} end
  if of ~= '' and of ~= epoch then
    return stale_end(rid, n, 6, budget_used, mode, epoch, finding, against, refund_ms)
  end
  local now = clock()
  local info = nil
  if mode == 'abandon' then info = redis.call('HGET', KEYS[1 + n * 5 + 2], rid) end
  if mode == 'abandon' then
    local exp = tonumber(redis.call('ZSCORE', KEYS[1 + n * 5 + 1], rid))
    if exp and exp > now then return -1 end   -- a heartbeat renewed it meanwhile
    if redis.call('GET', KEYS[1]) ~= '1' then   -- settled, abandoned already, or its marker
      local p = 1 + n * 5                         -- expired: out of the index, or it would
      redis.call('ZREM', KEYS[p + 1], rid)        -- come back first on every pass
      redis.call('HDEL', KEYS[p + 2], rid)
      redis.call('HDEL', KEYS[p + 3], rid)
      return 0
    end
  end
  local marker, held = finish(rid, n, 6)
  if not marker then return 0 end
  local reserved = held or tonumber(ARGV[4])
  if marker == 'r' then reserved = 0 end       -- the reconciler refunded the reservation
  local delta = fmt(budget_used - reserved)
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(6 + (i - 1) * 5)
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      if redis.call('ZSCORE', KEYS[k + 1], rid) then
        local old = tonumber(redis.call('HGET', KEYS[k + 2], rid)) or 0
        redis.call('HSET', KEYS[k + 2], rid, ARGV[3])
        redis.call('HINCRBY', KEYS[k + 2], '', fmt(used - old))
      end
    end
    -- A counter that is gone belongs to a period long over: nothing to adjust (and
    -- recreating it would leave a key without a TTL).
    if dayb >= 0 and redis.call('EXISTS', KEYS[k + 4]) == 1 then
      redis.call('INCRBY', KEYS[k + 4], delta)
    end
    if monthb >= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
      redis.call('INCRBY', KEYS[k + 5], delta)
    end
  end
  if mode == 'abandon' then refunded(info, refund_ms) end
  return 1

elseif op == 'cancel' then
  -- ARGV: rid, reserved tokens, window, n, the limits of each scope, then the lease's epoch
  -- and the lifetime of an 's' marker (ms).
  local rid = ARGV[2]
  local reserved = ARGV[3]
  local window = tonumber(ARGV[4])
  local n = tonumber(ARGV[5])
  local epoch = redis.call('GET', KEYS[#KEYS - 1])
  if not epoch then return {'rebuild'} end
  local of = ARGV[6 + n * 5]
  if of ~= '' and of ~= epoch then   -- what it held is in no counter: it only ends
    return stale_end(rid, n, 5, 0, 'cancel', epoch, 'counted', epoch, ARGV[7 + n * 5])
  end
  local now = clock()
  local marker, held = finish(rid, n, 5)
  if not marker then return 0 end
  if held then reserved = fmt(held) end
  if marker == 'r' then reserved = '0' end     -- the reconciler refunded the reservation
  local admitted = nil
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(5 + (i - 1) * 5)
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      local t = redis.call('ZSCORE', KEYS[k + 1], rid)
      if t then
        admitted = tonumber(t)
        local old = tonumber(redis.call('HGET', KEYS[k + 2], rid)) or 0
        redis.call('ZREM', KEYS[k + 1], rid)
        redis.call('HDEL', KEYS[k + 2], rid)
        redis.call('HINCRBY', KEYS[k + 2], '', fmt(-old))
      end
    end
    if dayb >= 0 and redis.call('EXISTS', KEYS[k + 4]) == 1 then
      redis.call('DECRBY', KEYS[k + 4], reserved)
    end
    if monthb >= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
      redis.call('DECRBY', KEYS[k + 5], reserved)
    end
  end
  -- It was in a window: its id stays taken until that entry would have left it.
  if admitted then
    redis.call('SET', KEYS[1], '0', 'PX', fmt(math.ceil((admitted + window - now) / 1000)))
  end
  return 1

elseif op == 'heartbeat' then
  -- KEYS: per lease: marker, then its lease sets; last, the pending index. ARGV: ttl,
  -- pending_ms, n, then per lease: request id, number of lease sets.
  local ttl = tonumber(ARGV[2])
  local pending_ms = ARGV[3]
  local n = tonumber(ARGV[4])
  local now = clock()
  local lease_ms = fmt(ttl / 1000 + 1000)
  local k, a, extended = 1, 5, 0
  for _ = 1, n do
    local rid, m = ARGV[a], tonumber(ARGV[a + 1])
    if redis.call('GET', KEYS[k]) == '1' then
      redis.call('PEXPIRE', KEYS[k], pending_ms)
      redis.call('ZADD', KEYS[#KEYS], 'XX', fmt(now + ttl), rid)
    end
    for j = 1, m do
      local key = KEYS[k + j]
      local exp = tonumber(redis.call('ZSCORE', key, rid))
      if exp and exp > now then
        redis.call('ZADD', key, 'XX', fmt(now + ttl), rid)
        redis.call('PEXPIRE', key, lease_ms)
        extended = extended + 1
      end
    end
    k, a = k + 1 + m, a + 2
  end
  return extended

elseif op == 'expired' then
  -- KEYS: pending, info, res (of one tag). ARGV: the most to return. Admissions whose lease
  -- ran out (no heartbeat for ttl): {request id, info, reserved}, oldest first, then the
  -- number of admissions the index holds. Read-only but for
  -- entries without an info, which nothing could reconcile (dropped).
  local now = clock()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(now), 'LIMIT', 0, tonumber(ARGV[2]))
  local out = {}
  for i = 1, #ids do
    local info = redis.call('HGET', KEYS[2], ids[i])
    if info then
      out[#out + 1] = {ids[i], info, redis.call('HGET', KEYS[3], ids[i]) or '0'}
    else
      redis.call('ZREM', KEYS[1], ids[i])
      redis.call('HDEL', KEYS[3], ids[i])
    end
  end
  return {now, out, redis.call('ZCARD', KEYS[1])}

elseif op == 'register' then
  -- KEYS: the registry of tags (sorted set: tag -> when last registered, ms on this node's
  -- clock). ARGV: the tag. Written before a request of the tag is admitted, never together
  -- with its keys (the registry is in a slot of its own on Redis Cluster).
  redis.call('ZADD', KEYS[1], fmt(math.floor(clock() / 1000)), ARGV[2])
  return 1

elseif op == 'tags' then
  -- KEYS: the registry. Every registered tag.
  return redis.call('ZRANGE', KEYS[1], 0, -1)

elseif op == 'prune' then
  -- KEYS: the registry. ARGV: a tag whose pending index was seen empty, the age (ms) past
  -- which it is dropped: only if nobody registered it again within that age.
  local seen = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]))
  if seen and seen <= math.floor(clock() / 1000) - tonumber(ARGV[3]) then
    redis.call('ZREM', KEYS[1], ARGV[2])
    return 1
  end
  return 0

elseif op == 'rebuild' then
  -- KEYS: the tag's epoch, then counters to set. ARGV: H (the highest usage row id the
  -- rebuild counted), a nonce, then per counter its value and its expiry (ms since the epoch).
  -- Only if the tag has no epoch (another replica may have rebuilt it meanwhile, and
  -- admitted against it since): returns the epoch in force.
  local epoch = redis.call('GET', KEYS[1])
  if epoch then return epoch end
  for i = 2, #KEYS do
    redis.call('SET', KEYS[i], ARGV[2 + (i - 1) * 2])
    redis.call('PEXPIREAT', KEYS[i], ARGV[3 + (i - 1) * 2])
  end
  epoch = ARGV[2] .. ':' .. fmt(clock()) .. ':' .. ARGV[3]
  redis.call('SET', KEYS[1], epoch)
  return epoch

elseif op == 'peek' then
  -- KEYS: a request's marker, its tag's epoch, its refund description. Read-only.
  return {redis.call('GET', KEYS[1]) or '', redis.call('GET', KEYS[2]) or '',
          redis.call('GET', KEYS[3]) or ''}

elseif op == 'replayed' then
  -- KEYS: a request's marker, its tag's epoch, its refund description, then the day and month
  -- counters to charge. ARGV: the row's tokens, what the caller saw ('r': refunded; '': no
  -- marker, its row uncounted by the rebuild of the epoch given), that epoch, the lifetime of
  -- the 's' marker (ms). Charges once: the marker becomes 's'. 1 charged, 0 not.
  local m = redis.call('GET', KEYS[1])
  if ARGV[3] == 'r' then
    if m ~= 'r' then return 0 end
  elseif m or redis.call('GET', KEYS[2]) ~= ARGV[4] then
    return 0
  end
  for i = 4, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], ARGV[2]) end
  end
  redis.call('SET', KEYS[1], 's', 'PX', ARGV[5])
  redis.call('DEL', KEYS[3])
  return 1

elseif op == 'usage' then
  -- KEYS: win, tok, lease, day, month. Read-only.
  local window = tonumber(ARGV[2])
  local now = clock()
  if now < tonumber(ARGV[3]) or now >= tonumber(ARGV[4])
     or now < tonumber(ARGV[5]) or now >= tonumber(ARGV[6]) then
    return {'clock', now}
  end
  -- then the admission times (us) of the oldest entry in the window and of the oldest one
  -- holding tokens, -1 for none
  local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. fmt(now - window), '+inf',
                          'WITHSCORES')
  local tokens, first, first_tokens = 0, -1, -1
  for i = 1, #live, 2 do
    local t = tonumber(redis.call('HGET', KEYS[2], live[i])) or 0
    tokens = tokens + t
    if first < 0 then first = tonumber(live[i + 1]) end
    if first_tokens < 0 and t > 0 then first_tokens = tonumber(live[i + 1]) end
  end
  local conc = redis.call('ZCOUNT', KEYS[3], '(' .. fmt(now), '+inf')
  local day = tonumber(redis.call('GET', KEYS[4]) or '0')
  local month = tonumber(redis.call('GET', KEYS[5]) or '0')
  return {'ok', now, math.floor(#live / 2), tokens, conc, day, month, fmt(first), fmt(first_tokens)}
end
return redis.error_reply('lockgate limiter: unknown op ' .. tostring(op))
