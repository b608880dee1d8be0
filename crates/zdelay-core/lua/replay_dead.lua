-- replay_dead: make dead envelope jobs due again. Each replayed job keeps its envelope (its
-- attempt count reset to 0 unless ARGV[5] says "keep"; last_error and everything else kept),
-- and the death it leaves is appended to its history: "<died ms> <reason>" (the dead score and
-- the reason, newlines in the reason turned to spaces, at most 500 bytes of it), one entry a
-- line, oldest first, only the last ARGV[6] entries kept.
-- KEYS[1] due      ZSET  {zdelay:3}:due
-- KEYS[2] jobs     HASH  {zdelay:3}:jobs      id -> envelope ("zd1:" frame or JSON object)
-- KEYS[3] dead     ZSET  {zdelay:3}:dead      member = id, score = ms it died
-- KEYS[4] reasons  HASH  {zdelay:3}:reasons   id -> why it died
-- KEYS[5] history  HASH  {zdelay:3}:history   id -> its earlier deaths, one "<died ms> <reason>" a line
-- KEYS[6] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] due for the replayed jobs: "" = Redis TIME (now), "<ms>" = epoch ms, "+<ms>" = that
--   many ms after Redis TIME
-- ARGV[3] wake channel; ARGV[4] shard number
-- ARGV[5] "reset": the envelope loses its top-level "attempt" (so it counts from 0 again);
--   "keep": the envelope is not touched
-- ARGV[6] history entries kept per id (the oldest are dropped)
-- ARGV[7..] pairs: id, the dead score it was selected with ("" = replay it whatever its score)
-- Returns: { replayed, orphans, skipped, due ms } where orphans are dead ids without an
--   envelope: they stay dead with their reason (there is nothing to deliver); skipped are ids
--   that are not dead, or died again since they were selected (their score moved).
-- Re-run safety: yes; a replayed job is no longer dead, so a second run skips it.

local shard_marker = KEYS[6]
-- @include shard_fence
local due_key, jobs_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local reset = ARGV[5] == 'reset'
local cap = tonumber(ARGV[6])

-- The JSON object text `obj` without its top-level "attempt" member; unchanged when it has
-- none, or its value is not a number, or `obj` is not an object. Strings are skipped with
-- their escapes and nesting is counted, so a header or a nested object never matches.
local function without_attempt(obj)
  if string.sub(obj, 1, 1) ~= '{' then return obj end
  local depth, i, n = 0, 1, #obj
  local sep = nil -- the '{' or ',' before the current top-level member
  while i <= n do
    local c = string.byte(obj, i)
    if c == 34 then -- '"': find the closing quote
      local j = i + 1
      while true do
        local q = string.find(obj, '["\\]', j)
        if not q then return obj end
        if string.byte(obj, q) == 92 then j = q + 2 else j = q break end
      end
      if depth == 1 and string.sub(obj, i, j) == '"attempt"'
          and string.find(string.sub(obj, sep + 1, i - 1), '^%s*$') then
        local _, vend = string.find(obj, '^%s*:%s*[-+%d.eE]+%s*', j + 1)
        if not vend then return obj end
        local after = string.byte(obj, vend + 1)
        if after == 44 then -- ',': drop the member and the comma after it
          return string.sub(obj, 1, sep) .. string.sub(obj, vend + 2)
        elseif after == 125 then -- '}': the last member; drop the comma before it, if any
          if string.byte(obj, sep) == 44 then
            return string.sub(obj, 1, sep - 1) .. string.sub(obj, vend + 1)
          end
          return string.sub(obj, 1, sep) .. string.sub(obj, vend + 1)
        end
        return obj
      end
      i = j + 1
    else
      if c == 123 or c == 91 then
        depth = depth + 1
        if depth == 1 then sep = i end
      elseif c == 125 or c == 93 then
        depth = depth - 1
      elseif c == 44 and depth == 1 then
        sep = i
      end
      i = i + 1
    end
  end
  return obj
end

-- The envelope with its attempt count reset, or nil when there is nothing to change. A
-- frame's meta is cut out the way move_due reads it; a malformed envelope is left alone (it
-- dies again with its reason).
local function reset_attempt(v)
  if string.sub(v, 1, 4) == 'zd1:' then
    local a = string.find(v, '\n', 5, true)
    local b = a and string.find(v, '\n', a + 1, true)
    local digits = b and string.sub(v, a + 1, b - 1)
    local meta_len = digits and string.find(digits, '^%d+$') and tonumber(digits)
    if not meta_len or meta_len == 0 or b + meta_len > #v then return nil end
    local meta = string.sub(v, b + 1, b + meta_len)
    local new_meta = without_attempt(meta)
    if new_meta == meta then return nil end
    if string.find(new_meta, '^{%s*}$') then new_meta = '' end
    return string.sub(v, 1, a) .. #new_meta .. '\n' .. new_meta .. string.sub(v, b + 1 + meta_len)
  elseif string.sub(v, 1, 1) == '{' then
    local new_v = without_attempt(v)
    if new_v == v then return nil end
    return new_v
  end
  return nil
end

local first_id = 7

-- A job stored under id waits again; with reset, its attempt count goes.
local function revive(id)
  local v = redis.call('HGET', jobs_key, id)
  if not v then return false end
  if reset then
    local new_v = reset_attempt(v)
    if new_v then redis.call('HSET', jobs_key, id, new_v) end
  end
  return true
end
-- @include clock
-- @include replay_dead_body
