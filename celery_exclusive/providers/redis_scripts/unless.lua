-- Runs before acquire.lua (the loader composes prelude.lua, unless.lua, acquire.lua as one
-- source): acquire KEYS[1] unless the lease on KEYS[3] is live (a dedupe queued marker,
-- refused while the task's run holds the execution key; both keys in one hash slot).
-- KEYS[1], KEYS[2], ARGV  as for acquire.lua (ARGV[5] unused); KEYS[3] the blocking lock hash
-- returns  {3, token, fence, created, expires, deadline, holder, now in µs} of the live lease
--          on KEYS[3]; else acquire.lua's reply for KEYS[1]
-- By hand: cat prelude.lua unless.lua acquire.lua > /tmp/unless.lua &&
--   redis-cli --eval /tmp/unless.lua 'KEY#queued' celery-exclusive:fences KEY , TOKEN 60000 60000 '{}'
local b = redis.call('HMGET', KEYS[3], 'token', 'fence', 'created', 'expires', 'deadline', 'holder')
if b[1] and (tonumber(b[4]) or 0) > now then
  return {3, b[1], b[2], b[3], b[4], b[5], b[6] or '', us}
end
