-- KEYS[i]  lock hashes (n of them, one hash slot)
-- ARGV[i]  token expected on KEYS[i]; ARGV[n + i] ttl ms for KEYS[i]
-- returns  one integer per key: µs the lease now has left, or -1 if not owned (unchanged)
-- The hash's TTL follows the lease's expiry (or its longest-kept completion record's).
-- Runs after prelude.lua: cat prelude.lua refresh.lua > /tmp/refresh.lua &&
--   redis-cli --eval /tmp/refresh.lua KEY1 KEY2 , TOKEN1 TOKEN2 30000 30000
local n = #KEYS
local out = {}
for i = 1, n do
  local r = redis.call('HMGET', KEYS[i], 'token', 'expires', 'deadline', 'done_max')
  out[i] = -1
  if r[1] == ARGV[i] and (tonumber(r[2]) or 0) > now then
    local expires = math.min(now + tonumber(ARGV[n + i]), tonumber(r[3]))
    if expires > now then
      local text, kept = int(expires), tonumber(r[4])
      redis.call('HSET', KEYS[i], 'expires', text)
      redis.call('PEXPIREAT', KEYS[i], kept and kept > expires and r[4] or text)
      out[i] = expires * 1000 - us
    end
  end
end
return out
