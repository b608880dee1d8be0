-- peek_dead: what listing and filtering dead jobs needs, without their payloads: per id, its
-- dead score, reason, history and the head of its envelope (a frame up to the end of its
-- meta, and the payload's size). Reads only.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] dead     ZSET  {zdelay:3}:dead
-- KEYS[3] reasons  HASH  {zdelay:3}:reasons
-- KEYS[4] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[5] shards   STRING {zdelay:3}:shards     layout marker: the shard count once resharded, or
--                                                "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2..] ids
-- Returns: per id, six values: dead score ("" when not dead), reason (""), history (""),
--   kind ("frame" | "other" | "none"), head, payload bytes. For a "frame", head is
--   "zd1:<dest>\n<meta length>\n<meta>" and payload bytes the size of the rest; for "other"
--   (a JSON envelope, or a malformed one), head is the first 64 KiB of the value and payload
--   bytes -1; for "none" (no envelope stored) head is "" and payload bytes -1.
-- Re-run safety: yes (reads only).

-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[5])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local out = {}
local HEAD_MAX = 65536
for i = 2, #ARGV do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[2], id) or ''
  local reason = redis.call('HGET', KEYS[3], id) or ''
  local history = redis.call('HGET', KEYS[4], id) or ''
  local v = redis.call('HGET', KEYS[1], id)
  local kind, head, size = 'none', '', -1
  if v then
    kind, head = 'other', string.sub(v, 1, HEAD_MAX)
    if string.sub(v, 1, 4) == 'zd1:' then
      local a = string.find(v, '\n', 5, true)
      local b = a and string.find(v, '\n', a + 1, true)
      local digits = b and string.sub(v, a + 1, b - 1)
      local meta_len = digits and string.find(digits, '^%d+$') and tonumber(digits)
      if meta_len and b + meta_len <= #v then
        kind, head, size = 'frame', string.sub(v, 1, b + meta_len), #v - b - meta_len
      end
    end
  end
  out[#out + 1] = score
  out[#out + 1] = reason
  out[#out + 1] = history
  out[#out + 1] = kind
  out[#out + 1] = head
  out[#out + 1] = size
end
return out
