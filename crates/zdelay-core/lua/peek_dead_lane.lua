-- peek_dead_lane: what listing, filtering and showing a route lane's dead jobs needs (storage
-- layout 2), within a byte budget: per stored id, its dead score, reason, history, meta, and
-- the size and first bytes of its payload. Reads only. The reply has peek_dead's shape, the
-- lane's meta framed as a zd1 head with the route as dest, so one reader serves both layouts.
-- KEYS[1] jobs     HASH   zdelay:{emj}:jobs:<route>     stored id -> payload (raw bytes)
-- KEYS[2] meta     HASH   zdelay:{emj}:meta:<route>     stored id -> meta JSON (only jobs with meta)
-- KEYS[3] dead     ZSET   zdelay:{emj}:dead:<route>     member = stored id, score = ms it died
-- KEYS[4] reasons  HASH   zdelay:{emj}:reasons:<route>  stored id -> why it died
-- KEYS[5] history  HASH   zdelay:{emj}:history:<route>  stored id -> its earlier deaths
-- KEYS[6] marker   STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] byte budget: meta and payload bytes read by one call (at least one id is read)
-- ARGV[3] payload preview: bytes of a payload returned (0: none, and no payload is read)
-- ARGV[4] the route (the dest of the head)
-- ARGV[5..] stored ids
-- Returns: per id read (a prefix of the ids), seven values as peek_dead: dead score ("" when
--   not dead), reason (its first 4096 bytes), history (""), kind, head, size, payload preview.
--   kind "frame": head is "zd1:<route>\n<meta length>\n<meta>", size the payload's bytes;
--   "other": a meta over 64 KiB, head its first 64 KiB; "large": a payload over READ_MAX asked
--   for a preview, not read (size only); "none": no payload stored (size -1).
-- Re-run safety: yes (reads only).

local lane_marker = KEYS[6]
-- @include lane_fence
local jobs_key, meta_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local budget = tonumber(ARGV[2])
local preview = tonumber(ARGV[3])
local route = ARGV[4]
local HEAD_MAX = 65536
local REASON_MAX = 4096
local READ_MAX = 4194304
local out = {}
local spent = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local size = redis.call('HSTRLEN', jobs_key, id)
  local meta = redis.call('HGET', meta_key, id) or ''
  local cost = #meta
  if preview > 0 and size <= READ_MAX then cost = cost + size end
  if i > 5 and spent + cost > budget then break end
  spent = spent + cost
  local score = redis.call('ZSCORE', dead_key, id) or ''
  local reason = string.sub(redis.call('HGET', reasons_key, id) or '', 1, REASON_MAX)
  local history = redis.call('HGET', history_key, id) or ''
  local kind, head, start = 'frame', '', ''
  -- HSTRLEN cannot tell an empty payload from a missing one.
  if size == 0 and redis.call('HEXISTS', jobs_key, id) == 0 then
    kind, size = 'none', -1
  elseif #meta > HEAD_MAX then
    kind, head = 'other', string.sub(meta, 1, HEAD_MAX)
  elseif preview > 0 and size > READ_MAX then
    kind = 'large'
  else
    head = 'zd1:' .. route .. '\n' .. #meta .. '\n' .. meta
    if preview > 0 and size > 0 then
      start = string.sub(redis.call('HGET', jobs_key, id), 1, preview)
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
