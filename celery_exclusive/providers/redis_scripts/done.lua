-- KEYS[i]  lock hashes (one hash slot)
-- ARGV[1]  a task id, or '' for every record
-- returns  {now, {i, field, value}...}: the completion records stored on KEYS[i]
--          (live or not: the caller compares their expiry with now)
-- Runs after prelude.lua: cat prelude.lua done.lua > /tmp/done.lua &&
--   redis-cli --eval /tmp/done.lua KEY1 KEY2 , ''
local out = {now}
for i = 1, #KEYS do
  if redis.call('TYPE', KEYS[i]).ok == 'hash' then
    if ARGV[1] ~= '' then
      local v = redis.call('HGET', KEYS[i], 'done:' .. ARGV[1])
      if v then out[#out + 1] = {i, 'done:' .. ARGV[1], v} end
    else
      local all = redis.call('HGETALL', KEYS[i])
      for j = 1, #all, 2 do
        if string.sub(all[j], 1, 5) == 'done:' then out[#out + 1] = {i, all[j], all[j + 1]} end
      end
    end
  end
end
return out
