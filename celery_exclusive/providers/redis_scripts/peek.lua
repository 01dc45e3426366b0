-- KEYS[i]  lock hashes (one hash slot)
-- returns  {now in µs, row_1, ..., row_n}; row_i is {token, fence, created, expires, deadline,
--          holder} for a live lease, or 0 if KEYS[i] is free or not a hash
-- Runs after prelude.lua: cat prelude.lua peek.lua > /tmp/peek.lua &&
--   redis-cli --eval /tmp/peek.lua KEY1 KEY2
local out = {us}
for i = 1, #KEYS do
  out[i + 1] = 0
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    local r = redis.call('HMGET', KEYS[i], 'token', 'fence', 'created', 'expires', 'deadline', 'holder')
    if r[1] and (tonumber(r[4]) or 0) > now then
      r[6] = r[6] or ''
      out[i + 1] = r
    end
  end
end
return out
