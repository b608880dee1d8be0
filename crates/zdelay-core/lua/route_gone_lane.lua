-- route_gone_lane: send one batch of the due jobs of a route lane to dead because no running
-- daemon's config has its route any more (it was removed, or renamed). Layout 1 sent such jobs
-- to dead as they fell due; a lane is polled only by daemons that have its route, so the daemons
-- that do not have it sweep it, once the route has been in no daemon's config for a while.
-- KEYS[1] due       ZSET   zdelay:{emj}:due:<route>       member = stored id, score = due ms
-- KEYS[2] maxlate   HASH   zdelay:{emj}:maxlate:<route>   stored id -> max lateness ms
-- KEYS[3] large     SET    zdelay:{emj}:large:<route>     stored ids with a payload over 4096 bytes
-- KEYS[4] dead      ZSET   zdelay:{emj}:dead:<route>      member = stored id, score = ms it died
-- KEYS[5] reasons   HASH   zdelay:{emj}:reasons:<route>   stored id -> why it died
-- KEYS[6] marker    STRING zdelay:{emj}:lane:<route>      "2 <lane> <LPUSH|RPUSH> <list key>"
-- KEYS[7] unique    HASH   zdelay:{emj}:unique:<route>    stored id -> its unique_for window ms
-- KEYS[8] windows   ZSET   zdelay:{emj}:windows:<route>   "u:<stored id>" -> ms until which it
--                                                         is a duplicate (enqueue_lane)
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as move_lane)
-- ARGV[2] batch size, at most 1000
-- ARGV[3] "now" in ms; "" = Redis TIME (tests pass an explicit value to drive time)
-- ARGV[4] the reason the dead jobs carry
-- Returns: { jobs sent to dead, 1 when more are due (call again), else 0 }
-- Payload and meta stay (a replay after the route is back delivers them), as for every dead
-- job; the unique window of each one is remembered.
-- Re-run safety: yes; a second run finds the jobs dead and takes the next due ones.

local lane_marker = KEYS[6]
-- @include lane_fence
local due_key, maxlate_key, large_key, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local unique_key, windows_key = KEYS[7], KEYS[8]
local batch = math.max(1, math.min(tonumber(ARGV[2]) or 1, 1000))
local now_ms
-- @include clock
now_ms = math.floor(clock_us(tonumber(ARGV[3])) / 1000)
-- @include remember
-- @include lane_kill
local ids = redis.call('ZRANGEBYSCORE', due_key, '-inf', now_ms, 'LIMIT', '0', batch + 1)
local more = 0
if #ids > batch then
  more = 1
  ids[#ids] = nil
end
if #ids == 0 then return { 0, 0 } end
kill_waiting(ids, ARGV[4])
return { #ids, more }
