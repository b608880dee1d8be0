-- schedule_request: records what a producer asks of a recurring schedule (set, pause, resume,
-- delete), for a daemon to apply: the next occurrence of a cron schedule in an IANA zone is
-- computed where the firing code runs, so a client in any language never plans one itself.
-- One entry per schedule id holds every request not applied yet, merged in the order asked:
-- a delete drops what was asked before it; a set keeps an earlier delete (applied first) and
-- an earlier pause or resume (applied after it, as a set keeps a schedule's pause); pause
-- and resume replace each other, and neither changes anything after a delete without a set.
-- KEYS[1] requests HASH {zdelay}:sched_requests  id -> {"seq","delete","set","paused"} JSON
-- KEYS[2] results  HASH {zdelay}:sched_results   id -> the last outcome (JSON with "seq");
--                                                field "" is the request sequence
-- ARGV[1] schedule id (non-empty, at most 512 bytes, no newline)
-- ARGV[2] set | pause | resume | delete
-- ARGV[3] set only: the schedule as one JSON object (the line form of schedule set --batch),
--   checked by the daemon that applies it; at most 16 MiB
-- Returns: the request's sequence number: the outcome is the results entry of the id once
--   its "seq" is at least this.
-- Errors: ZDELAY_BAD_REQUEST <why>; nothing is written.
-- Re-run safety: yes; a second run is a second request asking the same.
-- @include validate
if #KEYS ~= 2 then return bad_request('keys', keys_problem('2'), tostring(#KEYS)) end
local id, op, spec = ARGV[1], ARGV[2], ARGV[3]
if not id or id == '' or #id > 512 or string.find(id, '\n', 1, true) then
  return bad_request('id', 'must be non-empty, at most 512 bytes, without newlines', id)
end
if op ~= 'set' and op ~= 'pause' and op ~= 'resume' and op ~= 'delete' then
  return bad_request('op', 'must be set, pause, resume or delete', op)
end
if op == 'set' and (not spec or string.sub(spec, 1, 1) ~= '{' or #spec > 16777216) then
  return bad_request('schedule', 'set takes the schedule as one JSON object of at most 16 MiB', spec)
end
if #ARGV ~= (op == 'set' and 3 or 2) then
  return bad_request('arguments', 'set takes id, set, the schedule JSON; pause, resume and delete take id and the operation', tostring(#ARGV))
end
-- Braces only as a hash tag (user{42}:daily), so the schedule's occurrences land in its shard.
local tag = string.match(id, '{([^}]*)}')
if string.find(id, '[{}]') and (not tag or tag == '') then
  return bad_request('id', 'braces are only allowed as a hash tag, e.g. user{42}:daily', id)
end
local current = redis.call('HGET', KEYS[1], id)
local req = {}
if current then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and type(decoded) == 'table' then req = decoded end
end
if op == 'delete' then
  req = { delete = true }
elseif op == 'set' then
  req.set = spec
elseif not (req.delete and not req.set) then
  req.paused = (op == 'pause')
end
req.seq = redis.call('HINCRBY', KEYS[2], '', 1)
redis.call('HSET', KEYS[1], id, cjson.encode(req))
return req.seq
