-- get_job: one job of a spread shard, read in one call (the producer protocol's zd2_get;
-- no writes). The Rust library reads the same fields in one pipeline (Client::get).
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[7] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] job id
-- Returns: { Redis TIME seconds, microseconds, due score, ready member ("<sink>\n<due ms, 16
--   digits>\n<id>": due and waiting for its two-phase sink), inflight score (lease deadline),
--   dead score (ms it died), stored envelope, death reason }, each absent field nil. State:
--   due later than TIME: scheduled; due: due; a ready member: due, for its sink; inflight:
--   being delivered; dead: dead; only an envelope: orphan; nothing: unknown.
-- Re-run safety: yes (reads only).
-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 7 then return bad_request('keys', keys_problem('7'), tostring(#KEYS)) end
if #ARGV ~= 2 then return bad_request('arguments', 'this function takes 2: shards, id', tostring(#ARGV)) end
local why = shards_problem(ARGV[1])
if why then return bad_request('shards', why, ARGV[1]) end
why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end

local shard_marker = KEYS[7]
-- @include shard_fence
local id = ARGV[2]
-- @include clock
-- Redis TIME, as TIME answers it: a producer adds its namespace's test clock itself.
local now_us = clock_us()
local t = { string.format('%d', math.floor(now_us / 1000000)), string.format('%d', now_us % 1000000) }
return {
  t[1], t[2],
  redis.call('ZSCORE', KEYS[1], id),
  redis.call('HGET', KEYS[6], id),
  redis.call('ZSCORE', KEYS[3], id),
  redis.call('ZSCORE', KEYS[4], id),
  redis.call('HGET', KEYS[2], id),
  redis.call('HGET', KEYS[5], id),
}
