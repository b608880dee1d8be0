-- Included by every script that reads the time (`-- @include clock`), before any include that
-- uses it: clock_us(at_ms, offset_ms) is the one way a script reads "now", in µs. `at_ms` (a
-- number, ms) is the caller's now: a daemon on a namespace with a test clock passes the test
-- clock's time, tests a time of their own. Without it, Redis TIME plus `offset_ms` (a test
-- clock's offset, ms, that a producer sends; nil otherwise). A production namespace's caller
-- passes neither, so its scripts read TIME and nothing else.

local function clock_us(at_ms, offset_ms)
  if at_ms then return at_ms * 1000 end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]) + (offset_ms or 0) * 1000
end
