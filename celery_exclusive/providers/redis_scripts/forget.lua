-- KEYS[1]  the lock hash; ARGV[1] a task id
-- returns  1 if a live completion record of ARGV[1] was deleted, else 0
-- Runs after prelude.lua: cat prelude.lua forget.lua > /tmp/forget.lua &&
--   redis-cli --eval /tmp/forget.lua KEY , TASK_ID
local v = redis.call('HGET', KEYS[1], 'done:' .. ARGV[1])
if not v then return 0 end
redis.call('HDEL', KEYS[1], 'done:' .. ARGV[1])
if (tonumber(string.match(v, '^(%d+)|')) or 0) > now then return 1 end
return 0
