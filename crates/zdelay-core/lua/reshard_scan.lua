-- reshard_scan: one page of a shard key's members, without their values (envelopes do not
-- cross the wire), for zdelay reshard to find the ids a shard holds.
-- KEYS[1] key  HASH or ZSET  one key of one shard: {zdelay:3}:jobs, :due, :ready_ids, :ready …
-- ARGV[1] "hash" (HSCAN: the fields) or "zset" (ZSCAN: the members)
-- ARGV[2] cursor ("0" to start); ARGV[3] COUNT hint
-- Returns: { next cursor ("0" when the scan is complete), the bytes of the values the page
--   held (HSCAN returns them: the caller shrinks COUNT when they weigh much), then the fields
--   or members }; the SCAN guarantees hold: what stays in the key from start to end is
--   returned at least once.
-- Re-run safety: yes (read only).
local cmd = 'ZSCAN'
if ARGV[1] == 'hash' then cmd = 'HSCAN' end
local page = redis.call(cmd, KEYS[1], ARGV[2], 'COUNT', ARGV[3])
local items = page[2]
local bytes = 0
if cmd == 'HSCAN' then
  for i = 2, #items, 2 do bytes = bytes + #items[i] end
end
local out = { page[1], bytes }
for i = 1, #items, 2 do out[#out + 1] = items[i] end
return out
