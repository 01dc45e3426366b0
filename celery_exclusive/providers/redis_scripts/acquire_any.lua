-- KEYS[1..N]  the lock hashes of one semaphore's slots (in slot order), then KEYS[N+1] their
--          fence high-water key (one hash slot: providers/_redis_scripts.py, as acquire.lua)
-- ARGV[1]  token, ARGV[2] ttl ms, ARGV[3] max lifetime ms, ARGV[4] holder JSON
-- returns  {1, index (1-based), fence, µs left} for the first free slot taken (or the slot
--          ARGV[1] already holds), else {0, token, fence, created, expires, deadline, holder,
--          now in µs} of KEYS[1]'s live holder. Writes nothing when every slot is held.
-- Each slot is taken exactly as acquire.lua takes a key (same fields, fence from the
-- high-water key, PEXPIREAT).
-- Runs after prelude.lua: cat prelude.lua acquire_any.lua > /tmp/any.lua &&
--   redis-cli --eval /tmp/any.lua K '{K}#2' '{K}#3' celery-exclusive:fences , TOKEN 30000 60000 '{}'
local n = #KEYS - 1
local rows = {}
local free = nil
for i = 1, n do
  local key = KEYS[i]
  local r = redis.call('HMGET', key, 'token', 'fence', 'expires', 'created', 'deadline', 'holder',
                       'done_max')
  local expires = tonumber(r[3]) or 0
  if r[1] and expires > now then
    if r[1] == ARGV[1] then return {1, i, tonumber(r[2]), expires * 1000 - us} end
  elseif not free then
    free = i
  end
  rows[i] = r
end
if not free then
  local r = rows[1]
  return {0, r[1], r[2], r[4], r[3], r[5], r[6] or '', us}
end
local r = rows[free]
local life = tonumber(ARGV[3])
local ttl = math.min(tonumber(ARGV[2]), life)
local fence = math.max((tonumber(r[2]) or 0) + 1, us, (tonumber(redis.call('GET', KEYS[n + 1])) or 0) + 1)
-- Each time formatted once (an int() costs the server a few thousand instructions).
local fenced, expires, kept = int(fence), int(now + ttl), tonumber(r[7])
redis.call('SET', KEYS[n + 1], fenced)
redis.call('HSET', KEYS[free], 'token', ARGV[1], 'fence', fenced, 'created', int(now),
           'expires', expires, 'deadline', int(now + life), 'holder', ARGV[4])
redis.call('PEXPIREAT', KEYS[free], kept and kept > now + ttl and r[7] or expires)
return {1, free, fence, (now + ttl) * 1000 - us}
