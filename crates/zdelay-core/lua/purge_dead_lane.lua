-- purge_dead_lane: delete a route lane's dead jobs for good (storage layout 2): dead entry,
-- reason, payload, meta and history.
-- KEYS[1] jobs     HASH   zdelay:{emj}:jobs:<route>     stored id -> payload (raw bytes)
-- KEYS[2] meta     HASH   zdelay:{emj}:meta:<route>     stored id -> meta JSON (only jobs with meta)
-- KEYS[3] dead     ZSET   zdelay:{emj}:dead:<route>     member = stored id, score = ms it died
-- KEYS[4] reasons  HASH   zdelay:{emj}:reasons:<route>  stored id -> why it died
-- KEYS[5] history  HASH   zdelay:{emj}:history:<route>  stored id -> its earlier deaths
-- KEYS[6] marker   STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2..] pairs: stored id, the dead score it was selected with ("" = whatever its score)
-- Returns: { purged, skipped } where skipped are ids that are not dead, or died again since
--   they were selected (their score moved)
-- Re-run safety: yes; a purged id is no longer dead, so a second run skips it.

local lane_marker = KEYS[6]
-- @include lane_fence
local jobs_key, meta_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local purged, skipped = 0, 0
for i = 2, #ARGV, 2 do
  local id, selected = ARGV[i], ARGV[i + 1]
  local score = redis.call('ZSCORE', dead_key, id)
  if score and (selected == '' or tonumber(score) == tonumber(selected)) then
    redis.call('ZREM', dead_key, id)
    redis.call('HDEL', reasons_key, id)
    redis.call('HDEL', jobs_key, id)
    redis.call('HDEL', meta_key, id)
    redis.call('HDEL', history_key, id)
    purged = purged + 1
  else
    skipped = skipped + 1
  end
end
return { purged, skipped }
