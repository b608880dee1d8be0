-- Included by the enqueue scripts (`-- @include enqueue_policy`): reads the policy argument
-- (ARGV[2]: "replace" | "keep" | "error" | "debounce <max_wait ms>", then optionally
-- " unique <ms>"), refusing a malformed one, and sets policy, max_wait, unique_for, now_ms
-- and remembered (the call asks for a window and some id is remembered). Needs the local
-- windows_key.

local policy = string.match(ARGV[2], '^%a+')
local max_wait = tonumber(string.match(ARGV[2], '^debounce (%d+)'))
local unique_for = tonumber(string.match(ARGV[2], ' unique (%d+)$'))
if not (policy == 'replace' or policy == 'keep' or policy == 'error' or max_wait) then
  return redis.error_reply('ZDELAY_BAD_REQUEST policy: ' .. ARGV[2])
end
if (max_wait or unique_for) and not windows_key then
  return redis.error_reply('ZDELAY_BAD_REQUEST policy: debounce and unique need the unique and windows keys')
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Windows that ended are dropped here, so the set holds only live ones. A call that asks
-- for a window checks its ids against the remembered ones.
if windows_key then redis.call('ZREMRANGEBYSCORE', windows_key, '-inf', now_ms) end
local remembered = unique_for and redis.call('EXISTS', windows_key) == 1
