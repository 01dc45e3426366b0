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
local function int(n) return string.format('%.0f', n) end
