-- enqueue_lane: add jobs to one route lane (storage layout 2) and wake its mover when one of
-- them becomes the new head. A lane holds one local route's jobs in the hash slot of the
-- route's list, so its mover pushes and removes in one script on a cluster too.
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>     member = stored id, score = due ms
-- KEYS[2] jobs     HASH   zdelay:{emj}:jobs:<route>    stored id -> payload (raw bytes)
-- KEYS[3] meta     HASH   zdelay:{emj}:meta:<route>    stored id -> meta JSON (only jobs with meta)
-- KEYS[4] maxlate  HASH   zdelay:{emj}:maxlate:<route> stored id -> max lateness ms
-- KEYS[5] large    SET    zdelay:{emj}:large:<route>   stored ids whose payload is over 4096 bytes
--                                                       (the mover reads in smaller chunks while any
--                                                       is waiting)
-- KEYS[6] dead     ZSET   zdelay:{emj}:dead:<route>    member = stored id, score = ms it died
-- KEYS[7] reasons  HASH   zdelay:{emj}:reasons:<route> stored id -> why it died
-- KEYS[8] marker   STRING zdelay:{emj}:lane:<route>    "2 <lane> <LPUSH|RPUSH> <list key>" while
--                                                       live, "retired <successor>" once moved
-- KEYS[9] unique   HASH   zdelay:{emj}:unique:<route>  stored id -> its unique_for window ms
-- KEYS[10] windows ZSET   zdelay:{emj}:windows:<route> "u:<stored id>" -> ms until which it is
--                                                       a duplicate; "d:<stored id>" -> the
--                                                       latest due of a debounced job. Both
--                                                       optional, as in enqueue_jobs.
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   error ZDELAY_LANE_MOVED <successor> (retired: re-read the lane registry), ZDELAY_LANE_CHANGED
--   <marker> (re-read the registry), ZDELAY_NO_LANE (no marker: no daemon registered the route)
-- ARGV[2] policy for an id that exists (waiting or dead): "replace" | "keep" | "error" |
--   "debounce <max_wait ms>", then optionally " unique <ms>", then optionally " clock <ms>" (as
--   in enqueue_jobs)
-- ARGV[3] wake channel (zdelay:wake); ARGV[4] the lane's wake name ("l<lane>"), sent with the due
-- ARGV[5..] quintuples: id, due, payload, meta JSON ("" = none), max lateness in ms ("" = none).
--   due is epoch ms, or "+N" for N ms after Redis TIME.
-- Returns: one integer per job, in order: 1 added, 2 replaced, 0 kept (existing left as is),
--   -1 exists (policy "error"; nothing written for that job), 3 duplicate (delivered or dead
--   within its unique window; nothing written). A malformed policy is refused with
--   ZDELAY_BAD_REQUEST policy: …, writing nothing.
-- Re-run safety: yes. "replace" rewrites the same state; "keep"/"error" see the first run's writes.

-- @include validate
-- Every argument of every job is checked before the first write: a bad one refuses the call
-- whole (ZDELAY_BAD_REQUEST <field>: …, naming the job by its place in the call).
if #KEYS ~= 8 and #KEYS ~= 10 then return bad_request('keys', keys_problem('8 or 10'), tostring(#KEYS)) end
if not ARGV[1] then return bad_request('marker', 'must be the marker expected', nil) end
local why = policy_problem(ARGV[2])
if why then return bad_request('policy', why, ARGV[2]) end
if not ARGV[3] or ARGV[3] == '' then return bad_request('wake channel', 'must not be empty', ARGV[3]) end
if not string.find(ARGV[4] or '', '^l[0-9a-z]+$') then
  return bad_request('wake name', 'must be l<lane number>', ARGV[4])
end
if (#ARGV - 4) % 5 ~= 0 then
  return bad_request('job ' .. math.floor((#ARGV - 4) / 5) + 1,
    'each job takes 5 arguments: id, due, payload, meta JSON, max lateness', nil)
end
for i = 5, #ARGV, 5 do
  local n = i / 5
  why = id_problem(ARGV[i], true)
  if why then return bad_request('job ' .. n .. ' id', why, ARGV[i]) end
  why = due_problem(ARGV[i + 1])
  if why then return bad_request('job ' .. n .. ' due', why, ARGV[i + 1]) end
  local meta = ARGV[i + 3]
  if meta ~= '' and (string.byte(meta) ~= 123 or string.byte(meta, -1) ~= 125) then
    return bad_request('job ' .. n .. ' meta', 'must be a JSON object or empty', meta)
  end
  why = lateness_problem(ARGV[i + 4])
  if why then return bad_request('job ' .. n .. ' max lateness', why, ARGV[i + 4]) end
end

local lane_marker = KEYS[8]
-- @include lane_fence
local due_key, jobs_key, meta_key, maxlate_key, large_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local dead_key, reasons_key = KEYS[6], KEYS[7]
local unique_key, windows_key = KEYS[9], KEYS[10]
-- @include clock
-- @include enqueue_policy

local stride = 5

-- A replaced job leaves the dead set, if it was there.
local function leave(id)
  redis.call('ZREM', dead_key, id)
  redis.call('HDEL', reasons_key, id)
end

-- The payload (listed in large when over 4 KiB), its meta and its max lateness apart.
local function store(i, id, exists)
  local payload, meta, max_lateness = ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  redis.call('HSET', jobs_key, id, payload)
  if #payload > 4096 then
    redis.call('SADD', large_key, id)
  elseif exists then
    redis.call('SREM', large_key, id)
  end
  if meta ~= '' then
    redis.call('HSET', meta_key, id, meta)
  elseif exists then
    redis.call('HDEL', meta_key, id)
  end
  if max_lateness ~= '' then
    redis.call('HSET', maxlate_key, id, max_lateness)
  elseif exists then
    redis.call('HDEL', maxlate_key, id)
  end
end
-- @include enqueue_body
