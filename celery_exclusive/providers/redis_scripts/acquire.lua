-- KEYS[1]  the lock hash; KEYS[2] (optional) its fence high-water key: a string in the same
--          hash slot holding the largest fence granted there (providers/_redis_scripts.py)
-- ARGV[1]  token, ARGV[2] ttl ms, ARGV[3] max lifetime ms, ARGV[4] holder JSON,
--          ARGV[5] (optional) a task id whose completion record refuses the grant
-- returns  {1, fence, µs left} if granted (or already held by ARGV[1]),
--          {2, record, now in ms} if ARGV[5] has a live completion record, else
--          {0, token, fence, created, expires, deadline, holder, now in µs} of the live holder
-- A grant's fence is max(high-water + 1, previous fence + 1, TIME in microseconds), and the
-- high-water key is set to it; the hash lives until the lease expires (refresh.lua moves
-- that), or as long as its longest-kept completion record (field 'done_max').
-- Runs after prelude.lua: cat prelude.lua acquire.lua > /tmp/acquire.lua &&
--   redis-cli --eval /tmp/acquire.lua KEY celery-exclusive:fences , TOKEN 30000 60000 '{}'
-- ARGV[5]'s record is read by the same HMGET (a field more than one more call costs).
local r = redis.call('HMGET', KEYS[1], 'token', 'fence', 'expires', 'created', 'deadline', 'holder',
                     'done_max', ARGV[5] and 'done:' .. ARGV[5] or 'done_max')
local d = ARGV[5] and r[8]
if d and (tonumber(string.match(d, '^(%d+)|')) or 0) > now then return {2, d, now} end
local expires = tonumber(r[3]) or 0
if r[1] and expires > now then
  if r[1] == ARGV[1] then return {1, tonumber(r[2]), expires * 1000 - us} end
  return {0, r[1], r[2], r[4], r[3], r[5], r[6] or '', us}
end
local life = tonumber(ARGV[3])
local ttl = math.min(tonumber(ARGV[2]), life)
local fence = math.max((tonumber(r[2]) or 0) + 1, us)
if KEYS[2] then
  fence = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, fence)
end
-- Each time formatted once (an int() costs the server a few thousand instructions).
local fenced, expires = int(fence), int(now + ttl)
if KEYS[2] then redis.call('SET', KEYS[2], fenced) end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fenced, 'created', int(now),
           'expires', expires, 'deadline', int(now + life), 'holder', ARGV[4])
-- Completion records kept longer than the lease keep the hash alive as long. An absolute
-- time: PEXPIRE would count from the script's start, up to its run time before `now`.
local kept = tonumber(r[7])
redis.call('PEXPIREAT', KEYS[1], kept and kept > now + ttl and r[7] or expires)
return {1, fence, (now + ttl) * 1000 - us}
