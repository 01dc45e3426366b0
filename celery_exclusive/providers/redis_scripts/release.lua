-- KEYS[1]  the lock hash
-- ARGV[1]  token; optionally a completion record: ARGV[2] task id, ARGV[3] its stored
--          value 'expires|recorded|attempt|outcome' without the times, ARGV[4] retain ms
-- returns  1 if ARGV[1] held a live lease and it was deleted (2 when its release signal
--          reached a waiter's subscription), else 0 (a dead lease is
--          cleared either way); clearing deletes the hash, unless completion records keep
--          it (as long as the longest-kept one, field 'done_max'): the key's next fence
--          comes from the high-water key (acquire.lua)
-- A record is field 'done:<task id>' of the same hash (no key of its own, so one slot),
-- never replacing a live one of a later attempt (read by the first HMGET; the release goes
-- on without writing it);
-- expired records are pruned when the hash has doubled since the last pruning.
-- Runs after prelude.lua: cat prelude.lua release.lua > /tmp/release.lua &&
--   redis-cli --eval /tmp/release.lua KEY , TOKEN [TASK_ID 'ATTEMPT|OUTCOME' RETAIN_MS]
local field = ARGV[2] and 'done:' .. ARGV[2]
local r = redis.call('HMGET', KEYS[1], 'token', 'expires', 'done_max', field or 'done_max')
local owned, cleared = 0, false
if r[1] then
  local live = (tonumber(r[2]) or 0) > now
  if not (live and r[1] ~= ARGV[1]) then
    cleared = true
    if live then owned = 1 end
  end
end
-- A live lease freed wakes its waiters (providers/_redis_wake.py): SPUBLISH on channel
-- KEYS[1], in this script's slot on Cluster; pcall: Redis < 7 has none (waiters poll).
-- The count of subscribers it reached tells the releaser that someone waits (fairness).
if owned == 1 then
  local reached = redis.pcall('SPUBLISH', KEYS[1], '')
  if type(reached) == 'number' and reached > 0 then owned = 2 end
end
local keep = (tonumber(r[3]) or 0) - now
if field and r[4] then
  -- A live record of a later attempt stays: a late writer of an earlier attempt's record
  -- (a killed run recorded after the retry it had sent finished) must not turn it back.
  -- Its expiry is parsed only then (each parse costs the server a few thousand instructions).
  local attempt = tonumber(string.match(r[4], '^%d+|%d+|(%d+)|'))
  if attempt and attempt > tonumber(string.match(ARGV[3], '^%d+'))
      and tonumber(string.match(r[4], '^%d+')) > now then
    field = nil
  end
end
-- A cleared lease's hash that records keep loses the lease's fields; one they do not is
-- deleted whole at the end (an HDEL first would be a call for nothing).
if cleared and (keep > 0 or field) then
  redis.call('HDEL', KEYS[1], 'token', 'created', 'expires', 'deadline', 'holder')
end
-- The hash's end is absolute (PEXPIREAT): the longest-kept record's expiry, as text already
-- made ('done_max' as stored, or this record's), since each int() costs the server a few
-- thousand instructions (prelude.lua).
local last = keep > 0 and r[3]
if field then
  local retain = tonumber(ARGV[4])
  local until_ms = int(now + retain)
  if retain > keep then
    keep, last = retain, until_ms
    redis.call('HSET', KEYS[1], field, until_ms .. '|' .. int(now) .. '|' .. ARGV[3], 'done_max', until_ms)
  else
    redis.call('HSET', KEYS[1], field, until_ms .. '|' .. int(now) .. '|' .. ARGV[3])
  end
  -- Pruning counts the fields of a hash that held records before this one ('done_max' is
  -- written with the first): without them it holds this record, 'done_max', 'fence' and at
  -- most a live lease's five others, under the threshold's 16, so neither HLEN nor the
  -- HGET of 'done_scan' is needed to know that nothing is due.
  if r[3] then
    local n = redis.call('HLEN', KEYS[1])
    if n > 16 and n > 2 * (tonumber(redis.call('HGET', KEYS[1], 'done_scan')) or 0) + 16 then
      local all = redis.call('HGETALL', KEYS[1])
      for i = 1, #all, 2 do
        local gone = (tonumber(string.match(all[i + 1], '^(%d+)|')) or 0) <= now
        if string.sub(all[i], 1, 5) == 'done:' and gone then
          redis.call('HDEL', KEYS[1], all[i])
        end
      end
      redis.call('HSET', KEYS[1], 'done_scan', redis.call('HLEN', KEYS[1]))
    end
  end
  if not cleared and redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIREAT', KEYS[1], last) end
end
if cleared then
  if keep > 0 then redis.call('PEXPIREAT', KEYS[1], last) else redis.call('DEL', KEYS[1]) end
end
return owned
