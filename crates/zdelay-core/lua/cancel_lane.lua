-- cancel_lane: cancel a job waiting in a route lane (storage layout 2) by its stored id, O(log N).
-- Only a waiting job is cancelled: a dead one stays for dead replay/purge, a delivered one is gone.
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>     member = stored id, score = due ms
-- KEYS[2] jobs     HASH   zdelay:{emj}:jobs:<route>    stored id -> payload (raw bytes)
-- KEYS[3] meta     HASH   zdelay:{emj}:meta:<route>    stored id -> meta JSON (only jobs with meta)
-- KEYS[4] maxlate  HASH   zdelay:{emj}:maxlate:<route> stored id -> max lateness ms
-- KEYS[5] large    SET    zdelay:{emj}:large:<route>   stored ids whose payload is over 4096 bytes
-- KEYS[6] marker   STRING zdelay:{emj}:lane:<route>    "2 <lane> <LPUSH|RPUSH> <list key>" while
--                                                       live, "retired <successor>" once moved
-- KEYS[7] unique   HASH   zdelay:{emj}:unique:<route> stored id -> its unique_for window
--                                                      (required: a cancelled job's window goes
--                                                      with it, so a later job never inherits it)
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] stored id
-- Returns: 1 cancelled; 0 not waiting (delivered, dead, cancelled or never enqueued: nothing changed)
-- Re-run safety: yes; a second run returns 0.

-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 7 then return bad_request('keys', keys_problem('7'), tostring(#KEYS)) end
if #ARGV ~= 2 then return bad_request('arguments', 'this function takes 2: marker, id', tostring(#ARGV)) end
local why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end

local lane_marker = KEYS[6]
-- @include lane_fence
local id = ARGV[2]
-- Waiting means in due: a dead job keeps its payload in jobs, so jobs cannot tell.
if redis.call('ZREM', KEYS[1], id) == 0 then return 0 end
redis.call('HDEL', KEYS[2], id)
redis.call('HDEL', KEYS[3], id)
redis.call('HDEL', KEYS[4], id)
redis.call('SREM', KEYS[5], id)
redis.call('HDEL', KEYS[7], id)
return 1
