-- get_lane: one job of a route lane (storage layout 2), read in one call (the producer
-- protocol's zd2_get_lane; no writes). The Rust library reads the same fields in one pipeline.
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>     member = stored id, score = due ms
-- KEYS[2] jobs     HASH   zdelay:{emj}:jobs:<route>    stored id -> payload (raw bytes)
-- KEYS[3] meta     HASH   zdelay:{emj}:meta:<route>    stored id -> meta JSON (only jobs with meta)
-- KEYS[4] maxlate  HASH   zdelay:{emj}:maxlate:<route> stored id -> max lateness ms
-- KEYS[5] dead     ZSET   zdelay:{emj}:dead:<route>    member = stored id, score = ms it died
-- KEYS[6] reasons  HASH   zdelay:{emj}:reasons:<route> stored id -> why it died
-- KEYS[7] marker   STRING zdelay:{emj}:lane:<route>    "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects: another value refuses the call (ZDELAY_LANE_MOVED,
--   ZDELAY_LANE_CHANGED, ZDELAY_NO_LANE, as enqueue_lane)
-- ARGV[2] stored id
-- Returns: { Redis TIME seconds, microseconds, due score, payload, meta JSON, max lateness ms,
--   dead score, death reason }, each absent field nil. State: due later than TIME: scheduled;
--   due: due; dead: dead; only a payload: orphan; nothing: unknown.
-- Re-run safety: yes (reads only).
-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 7 then return bad_request('keys', keys_problem('7'), tostring(#KEYS)) end
if #ARGV ~= 2 then return bad_request('arguments', 'this function takes 2: marker, id', tostring(#ARGV)) end
local why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end

local lane_marker = KEYS[7]
-- @include lane_fence
local id = ARGV[2]
-- @include clock
-- Redis TIME, as TIME answers it: a producer adds its namespace's test clock itself.
local now_us = clock_us()
local t = { string.format('%d', math.floor(now_us / 1000000)), string.format('%d', now_us % 1000000) }
return {
  t[1], t[2],
  redis.call('ZSCORE', KEYS[1], id),
  redis.call('HGET', KEYS[2], id),
  redis.call('HGET', KEYS[3], id),
  redis.call('HGET', KEYS[4], id),
  redis.call('ZSCORE', KEYS[5], id),
  redis.call('HGET', KEYS[6], id),
}
