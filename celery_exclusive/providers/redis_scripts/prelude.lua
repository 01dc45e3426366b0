-- The prelude every script of this folder runs after: the loader (providers/_redis_scripts.py)
-- sends prelude.lua followed by the script, as one source. By hand, the same:
--   cat prelude.lua peek.lua > /tmp/peek.lua && redis-cli --eval /tmp/peek.lua KEY1 KEY2 , ARGS
-- (keys before the comma, arguments after it; each script's header names them).
--
-- `now` is the stored unit (ms, rounded down); every time a script *returns* is in µs,
-- measured from `us`, so a holder is never told its lease lasts longer than it does:
-- a lease stored as ending at `expires` ms is dead from `expires * 1000` µs on.
local t = redis.call('TIME')
local us = t[1] * 1000000 + t[2]
local now = t[1] * 1000 + math.floor(t[2] / 1000)
-- Numbers are written as plain integers: Redis 7.2+ would format 1.7e15 as "1.7e+15".
-- '%d' (a C long) costs the server about half of '%.0f' (a double's digits), but a long
-- is 32 bits on a 32-bit build, too small for ms and µs times: such a build keeps '%.0f'.
-- The test is made at a call's first int() (a script without one pays nothing).
local long
local function int(n)
  if long == nil then long = string.format('%d', 1099511627776) == '1099511627776' end
  return string.format(long and '%d' or '%.0f', n)
end
