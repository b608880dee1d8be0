-- Included by the enqueue scripts (`-- @include enqueue_policy`): reads the policy argument
-- (ARGV[2]: "replace" | "keep" | "error" | "debounce <max_wait ms>", then optionally
-- " unique <ms>", then optionally " clock <ms>": the offset of the namespace's test clock),
-- refusing a malformed one, and sets policy, max_wait, unique_for, now_ms (Redis TIME plus that
-- offset) and remembered (the call asks for a window and some id is remembered). Needs the
-- local windows_key and include clock.

local clock_offset = tonumber(string.match(ARGV[2], ' clock (%d+)$'))
local policy_arg = string.gsub(ARGV[2], ' clock %d+$', '')
local policy = string.match(policy_arg, '^%a+')
local max_wait = tonumber(string.match(policy_arg, '^debounce (%d+)'))
local unique_for = tonumber(string.match(policy_arg, ' unique (%d+)$'))
if not (policy == 'replace' or policy == 'keep' or policy == 'error' or max_wait) then
  return redis.error_reply('ZDELAY_BAD_REQUEST policy: ' .. ARGV[2])
end
if (max_wait or unique_for) and not windows_key then
  return redis.error_reply('ZDELAY_BAD_REQUEST policy: debounce and unique need the unique and windows keys')
end
local now_ms = math.floor(clock_us(nil, clock_offset) / 1000)
-- Windows that ended are dropped here, the oldest first and at most 500 more than the call
-- has arguments (after a quiet spell millions may have ended): each call drops more than it
-- can add, and the daemons drop those of lanes no call reaches. An ended window may still be
-- in the set, so a call reads one through live_window. A call that asks for a window checks
-- its ids against the remembered ones.
if windows_key then
  local ended = redis.call('ZCOUNT', windows_key, '-inf', now_ms)
  if ended > 0 then redis.call('ZREMRANGEBYRANK', windows_key, 0, math.min(ended, 500 + #ARGV) - 1) end
end
-- The end (ms) of the window `member` of the set names, while it has not ended.
local function live_window(member)
  local ends = tonumber(redis.call('ZSCORE', windows_key, member))
  if ends and ends > now_ms then return ends end
  return nil
end
local remembered = unique_for and redis.call('EXISTS', windows_key) == 1
