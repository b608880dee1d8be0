-- reschedule_lane: move a job waiting in a route lane (storage layout 2) to a new due time,
-- O(log N), waking the lane's mover when the job becomes the lane's new head. Its max lateness
-- stays (as reschedule_job), measured from the new due time.
-- KEYS[1] due      ZSET   zdelay:{emj}:due:<route>     member = stored id, score = due ms
-- KEYS[2] marker   STRING zdelay:{emj}:lane:<route>    "2 <lane> <LPUSH|RPUSH> <list key>" while
--                                                       live, "retired <successor>" once moved
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2] stored id
-- ARGV[3] new due: epoch ms, or "+N" for N ms after Redis TIME
-- ARGV[4] wake channel (zdelay:wake); ARGV[5] the lane's wake name ("l<lane>"), sent with the due
-- Returns: the new due ms, or nil when the job is not waiting (delivered, dead, cancelled or never
--   enqueued: nothing changed)
-- Re-run safety: yes (absolute times); a relative time is measured again from the re-run.

-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 2 then return bad_request('keys', keys_problem('2'), tostring(#KEYS)) end
if #ARGV ~= 5 then return bad_request('arguments', 'this function takes 5: marker, id, new due, wake channel, wake name', tostring(#ARGV)) end
local why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end
why = due_problem(ARGV[3])
if why then return bad_request('new due', why, ARGV[3]) end
if ARGV[4] == '' then return bad_request('wake channel', 'must not be empty', ARGV[4]) end
if not string.find(ARGV[5], '^l[0-9a-z]+$') then return bad_request('wake name', 'must be l<lane number>', ARGV[5]) end

local lane_marker = KEYS[2]
-- @include lane_fence
-- @include clock
local due_key, id = KEYS[1], ARGV[2]
-- Waiting means in due: a dead job keeps its payload in jobs, and stays dead.
if not redis.call('ZSCORE', due_key, id) then return false end
local due
if string.sub(ARGV[3], 1, 1) == '+' then
  -- Redis TIME: a producer on a test clock adds its offset to N itself.
  due = math.floor(clock_us() / 1000) + tonumber(string.sub(ARGV[3], 2))
else
  due = tonumber(ARGV[3])
end
-- The head before the change, as enqueue_lane reads it: the mover sleeps until that one is due,
-- so only an earlier due needs a wake (a later one is found when the mover wakes then).
local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
local head_score = tonumber(head[2])
redis.call('ZADD', due_key, 'XX', due, id)
if due < head_score then
  redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. string.format('%d', due))
end
return due
