-- replay_dead_lane: make a route lane's dead jobs due again (storage layout 2). The death each
-- leaves is appended to its history, as replay_dead does: "<died ms> <reason>" (newlines in the
-- reason turned to spaces, at most 500 bytes of it), one entry a line, oldest first, only the
-- last ARGV[5] entries kept. Local routes count no delivery attempts, so there is no attempt
-- count to reset. A payload over 4096 bytes is listed in the large set again (the move reads
-- the lane in smaller chunks while it holds any).
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>      member = stored id, score = due ms
-- KEYS[2] jobs     HASH   zdelay:{emj}:jobs:<route>     stored id -> payload (raw bytes)
-- KEYS[3] large    SET    zdelay:{emj}:large:<route>    stored ids whose payload is over 4096 bytes
-- KEYS[4] dead     ZSET   zdelay:{emj}:dead:<route>     member = stored id, score = ms it died
-- KEYS[5] reasons  HASH   zdelay:{emj}:reasons:<route>  stored id -> why it died
-- KEYS[6] history  HASH   zdelay:{emj}:history:<route>  stored id -> its earlier deaths
-- KEYS[7] marker   STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] due for the replayed jobs: "" = Redis TIME (now), "<ms>" = epoch ms, "+<ms>" = that
--   many ms after Redis TIME
-- ARGV[3] wake channel; ARGV[4] the lane's wake name ("l<lane>")
-- ARGV[5] history entries kept per id (the oldest are dropped)
-- ARGV[6..] pairs: stored id, the dead score it was selected with ("" = whatever its score)
-- Returns: { replayed, orphans, skipped, due ms } as replay_dead: orphans are dead ids without a
--   payload (they stay dead: there is nothing to deliver); skipped are ids that are not dead,
--   or died again since they were selected (their score moved).
-- Re-run safety: yes; a replayed job is no longer dead, so a second run skips it.

local lane_marker = KEYS[7]
-- @include lane_fence
local due_key, jobs_key, large_key, dead_key, reasons_key, history_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local cap = tonumber(ARGV[5])
local first_id = 6
local SMALL = 4096

-- A job stored under id waits again: listed in large when its payload is over SMALL.
local function revive(id)
  if redis.call('HEXISTS', jobs_key, id) == 0 then return false end
  if redis.call('HSTRLEN', jobs_key, id) > SMALL then redis.call('SADD', large_key, id) end
  return true
end
-- @include clock
-- @include replay_dead_body
