-- Included by the producer scripts (`-- @include validate`): the checks that refuse a malformed
-- argument before anything is written (docs/reference/protocol.md, "Bad requests"). Each
-- *_problem(value) answers nil for a good value, else what is allowed; bad_request builds the
-- reply. Plain string matches only, no tables: the enqueue path is hot.

-- The reply to a malformed argument: ZDELAY_BAD_REQUEST <field>: <what is allowed>, got <value>,
-- with at most 40 bytes of the value, anything but printable ASCII shown as '?'.
local function bad_request(field, why, value)
  local got = 'nothing'
  if value then
    got = '"' .. string.gsub(string.sub(value, 1, 40), '[^%w%p ]', '?') .. '"'
    if #value > 40 then got = got .. ' (' .. #value .. ' bytes)' end
  end
  return redis.error_reply('ZDELAY_BAD_REQUEST ' .. field .. ': ' .. why .. ', got ' .. got)
end

-- A due time: epoch milliseconds (not one that reads as epoch seconds: 1e9 .. 1e11 ms is
-- 1970-01-12 .. 1973-03-03, when nobody schedules a job) or +<ms> after the server's clock.
local function due_problem(due)
  local n = due and #due or 0
  if n == 0 or n > 16 or not string.find(due, '^%+?%d+$') or due == '+' or (n == 16 and string.byte(due) ~= 43) then
    return 'must be epoch milliseconds or +<milliseconds>, at most 15 digits'
  end
  if (n == 10 or n == 11) and string.byte(due) ~= 43 then
    local ms = tonumber(due)
    if ms >= 1e9 and ms < 1e11 then
      return 'looks like epoch seconds: due times are epoch milliseconds'
    end
  end
  return nil
end

-- A job id: 1 to 256 bytes. `stored` (an id being enqueued): not starting with '~', which
-- marks the ids layout 2 generates (a lane stores those without it).
local function id_problem(id, stored)
  if not id or id == '' or #id > 256 then return 'must be 1 to 256 bytes' end
  if stored and string.byte(id) == 126 then
    return 'must not start with ~ (reserved for generated ids)'
  end
  return nil
end

-- A max lateness: milliseconds, or empty for none.
local function lateness_problem(ms)
  if ms ~= '' and (not ms or #ms > 15 or not string.find(ms, '^%d+$')) then
    return 'must be milliseconds (at most 15 digits) or empty'
  end
  return nil
end

-- The conflict policy, whole: replace | keep | error | debounce <ms>, then optionally
-- " unique <ms>" (the include enqueue_policy reads it, trusting this check).
local function policy_problem(policy)
  if policy == 'replace' or policy == 'keep' or policy == 'error' then return nil end
  local shape = 'must be replace, keep, error or debounce <ms>, then optionally unique <ms>, then optionally clock <ms>'
  if not policy then return shape end
  local clock = string.match(policy, ' clock (%d+)$')
  if clock and #clock > 15 then return shape end
  policy = string.gsub(policy, ' clock %d+$', '')
  local base = string.match(policy, '^(.-) unique %d+$') or policy
  local windows = string.match(policy, ' unique (%d+)$')
  local wait = string.match(base, '^debounce (%d+)$')
  if not (base == 'replace' or base == 'keep' or base == 'error' or wait)
    or (wait and #wait > 15) or (windows and #windows > 15) then
    return shape
  end
  return nil
end

-- The shard count a layout-1 caller computed its shard with: 1 to 16384.
local function shards_problem(shards)
  local digits = shards and string.match(shards, '^[1-9]%d?%d?%d?%d?$')
  if not digits or tonumber(digits) > 16384 then return 'must be a shard count, 1 to 16384' end
  return nil
end

-- A key count the function does not take: its keys are positional, so a missing one would
-- shift the others.
local function keys_problem(counts)
  return 'this function takes ' .. counts .. ' keys'
end
