-- peek_dead: what listing, filtering and showing a job needs, within a byte budget: per id, its
-- dead score, reason, history, the head of its envelope (a frame up to the end of its meta) and
-- the first bytes of its payload. Reads only. Ids are read in order until the envelopes read
-- add up to the budget (at least one id is read): the caller sends the rest again.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[5] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] byte budget: envelope bytes read by one call (HSTRLEN, before reading)
-- ARGV[3] payload preview: bytes of a frame's payload returned (0: none)
-- ARGV[4..] ids
-- Returns: per id read (a prefix of the ids), seven values: dead score ("" when not dead),
--   reason (its first 4096 bytes; ""), history (""), kind ("frame" | "other" | "none"), head,
--   size, payload preview. For a "frame", head is "zd1:<dest>\n<meta length>\n<meta>" (at most
--   64 KiB of meta), size the payload's bytes and the preview its first ARGV[3] bytes; for
--   "other" (a JSON envelope, a malformed one, or a frame whose meta exceeds 64 KiB), head is
--   the first 64 KiB of the value, size the value's bytes, preview ""; for "large" (a value
--   over READ_MAX, not read: Redis has no partial read of a hash field, and copying 64 MiB
--   into Lua holds the server for a quarter of a second) head and preview are "" and size
--   the value's bytes; for "none" (no envelope stored) head and preview are "" and size -1.
-- Re-run safety: yes (reads only).

local shard_marker = KEYS[5]
-- @include shard_fence
local budget = tonumber(ARGV[2])
local preview = tonumber(ARGV[3])
local HEAD_MAX = 65536
local REASON_MAX = 4096
local READ_MAX = 4194304
local out = {}
local spent = 0
for i = 4, #ARGV do
  local id = ARGV[i]
  local stored = redis.call('HSTRLEN', KEYS[1], id)
  local cost = stored
  if stored > READ_MAX then
    cost = 0
  end
  if i > 4 and spent + cost > budget then
    break
  end
  spent = spent + cost
  local score = redis.call('ZSCORE', KEYS[2], id) or ''
  local reason = string.sub(redis.call('HGET', KEYS[3], id) or '', 1, REASON_MAX)
  local history = redis.call('HGET', KEYS[4], id) or ''
  local kind, head, size, start = 'none', '', -1, ''
  if stored > READ_MAX then
    kind, size = 'large', stored
  elseif stored > 0 then
    local v = redis.call('HGET', KEYS[1], id)
    kind, head, size = 'other', string.sub(v, 1, HEAD_MAX), #v
    if string.sub(v, 1, 4) == 'zd1:' then
      local a = string.find(v, '\n', 5, true)
      local b = a and string.find(v, '\n', a + 1, true)
      local digits = b and string.sub(v, a + 1, b - 1)
      local meta_len = digits and string.find(digits, '^%d+$') and tonumber(digits)
      if meta_len and meta_len <= HEAD_MAX and b + meta_len <= #v then
        local payload_at = b + meta_len + 1
        kind, head, size = 'frame', string.sub(v, 1, b + meta_len), #v - b - meta_len
        if preview > 0 then
          start = string.sub(v, payload_at, payload_at + preview - 1)
        end
      end
    end
  end
  out[#out + 1] = score
  out[#out + 1] = reason
  out[#out + 1] = history
  out[#out + 1] = kind
  out[#out + 1] = head
  out[#out + 1] = size
  out[#out + 1] = start
end
return out
