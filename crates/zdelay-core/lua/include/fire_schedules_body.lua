-- Included after their fences by fire_schedules and fire_schedules_lane: firing is the same in
-- a spread shard and in a route lane (the arguments, the bound, the marks, the misfire
-- decisions the caller made); only how an occurrence is written as a job differs. The includer
-- names its keys (due_key, dead_key, reasons_key, limit_key, schedules_key, env_key,
-- sched_due_key, fired_key, quarantine_key, health_key) and defines occurrences(envelope): a table with
-- write(job) (false when the id is taken: written already, waiting or dead) and waiting(job)
-- (after a job was written due), or nil and why the envelope cannot be fired.

local MAX_OCCURRENCES = 1000
local now = tonumber(ARGV[2])
-- Where each schedule's arguments start, and the bound, before anything is written.
local starts, total, i = {}, 0, 4
while i <= #ARGV do
  starts[#starts + 1] = i
  local deliver = tonumber(ARGV[i + 9])
  local expired = tonumber(ARGV[i + 10 + 3 * deliver])
  total = total + deliver + expired
  i = i + 11 + 3 * deliver + 2 * expired
end
if total > MAX_OCCURRENCES then
  return redis.error_reply('ZDELAY_FIRE_BOUND ' .. total)
end
local old = redis.call('ZRANGEBYSCORE', fired_key, '-inf', '(' .. (now - tonumber(ARGV[3])),
  'LIMIT', 0, 100)
if #old > 0 then redis.call('ZREM', fired_key, unpack(old)) end
-- Each schedule's state, read for all of them at once (a few variadic reads instead of five
-- calls a schedule: per call, not per element, is most of a script's cost), in chunks that
-- unpack takes. A schedule named twice in one call: the second is fenced, as it would be
-- after the first changed its pending occurrence.
local CHUNK = 1000
-- read(from, to) reads ids[from..to]; their answers, in order.
local function read_all(read, count)
  local out = {}
  for from = 1, count, CHUNK do
    local part = read(from, math.min(from + CHUNK - 1, count))
    for k = 1, #part do out[from + k - 1] = part[k] end
  end
  return out
end
local ids, repeated, named = {}, {}, {}
for k, s in ipairs(starts) do
  ids[k] = ARGV[s]
  if named[ARGV[s]] then repeated[k] = true end
  named[ARGV[s]] = true
end
local read_scores = read_all(function(a, b)
  return redis.call('ZMSCORE', sched_due_key, unpack(ids, a, b)) end, #ids)
local read_records = read_all(function(a, b)
  return redis.call('HMGET', schedules_key, unpack(ids, a, b)) end, #ids)
local read_envelopes = read_all(function(a, b)
  return redis.call('HMGET', env_key, unpack(ids, a, b)) end, #ids)
local read_marks = read_all(function(a, b)
  return redis.call('ZMSCORE', fired_key, unpack(ids, a, b)) end, #ids)
local read_healths = read_all(function(a, b)
  return redis.call('HMGET', health_key, unpack(ids, a, b)) end, #ids)
-- Writes that nothing in this call reads again, made at its end, a few commands each.
local due_adds, health_sets, mark_adds, pending_adds, pending_ends = {}, {}, {}, {}, {}
-- write(from, to) writes args[from..to]: pairs, a chunk of them at a time.
local function write_all(write, args)
  for from = 1, #args, 2 * CHUNK do write(from, math.min(from + 2 * CHUNK - 1, #args)) end
end
local created, expired, fenced, quarantined = 0, 0, 0, {}
local missed_total, skipped_total = 0, 0
-- A schedule's health record: "<fired> <missed> <expired> <skipped by calendar> <last fired ms>
-- <its occurrence ms>" (the last two empty as "-" until it first fires). One field per
-- schedule, six numbers: written here, in the step that decides the occurrences, so the counts
-- are exact whichever daemon fires and whatever crashes.
local function add_health(id, old, fired, missed, expired_n, skipped, last_at)
  if fired + missed + expired_n + skipped == 0 then return end
  local h = { 0, 0, 0, 0, '-', '-' }
  if old then
    local k = 1
    for word in string.gmatch(old, '%S+') do
      if k <= 6 then h[k] = word end
      k = k + 1
    end
  end
  h[1] = (tonumber(h[1]) or 0) + fired
  h[2] = (tonumber(h[2]) or 0) + missed
  h[3] = (tonumber(h[3]) or 0) + expired_n
  h[4] = (tonumber(h[4]) or 0) + skipped
  if last_at then h[5], h[6] = now, last_at end
  local function ms(v) return v == '-' and '-' or string.format('%d', tonumber(v)) end
  health_sets[#health_sets + 1] = id
  health_sets[#health_sets + 1] = string.format('%d %d %d %d %s %s', h[1], h[2], h[3], h[4],
    ms(h[5]), ms(h[6]))
end
local function quarantine(id, reason)
  redis.call('ZREM', sched_due_key, id)
  redis.call('HSET', quarantine_key, id, now .. ' ' .. reason)
  quarantined[#quarantined + 1] = id
  quarantined[#quarantined + 1] = reason
end
for at, s in ipairs(starts) do
  local id, read_due, read_version = ARGV[s], ARGV[s + 1], ARGV[s + 2]
  local set_mark, next_ms, limit, reason = ARGV[s + 3], ARGV[s + 4], ARGV[s + 5], ARGV[s + 6]
  local missed, skipped = tonumber(ARGV[s + 7]), tonumber(ARGV[s + 8])
  local deliver = tonumber(ARGV[s + 9])
  local first_deliver = s + 10
  local n_expired = tonumber(ARGV[first_deliver + 3 * deliver])
  local first_expired = first_deliver + 3 * deliver + 1
  local score, record = read_scores[at], read_records[at]
  local version = record and string.match(record, '^(%d+)\n') or ''
  if repeated[at] or score ~= read_due or version ~= read_version then
    fenced = fenced + 1
  elseif not record then
    -- No definition (removed by hand): nothing to fire, its occurrence goes.
    redis.call('ZREM', sched_due_key, id)
  elseif reason ~= '' then
    quarantine(id, reason)
  else
    local envelope = read_envelopes[at]
    local occurrence, problem = nil, 'no envelope stored for its occurrences'
    if envelope then occurrence, problem = occurrences(envelope) end
    if not occurrence then
      quarantine(id, problem)
    else
      local mark = read_marks[at] and tonumber(read_marks[at])
      local fired_here, expired_here, last_at = 0, 0, nil
      for k = 0, deliver - 1 do
        local job, at = ARGV[first_deliver + 3 * k], ARGV[first_deliver + 3 * k + 1]
        local due = ARGV[first_deliver + 3 * k + 2]
        if (not mark or tonumber(at) > mark) and occurrence.write(job) then
          due_adds[#due_adds + 1] = due
          due_adds[#due_adds + 1] = job
          if limit ~= '' then redis.call('HSET', limit_key, job, limit) end
          occurrence.waiting(job)
          created = created + 1
          fired_here = fired_here + 1
          last_at = tonumber(at)
        end
      end
      for k = 0, n_expired - 1 do
        local job, at = ARGV[first_expired + 2 * k], ARGV[first_expired + 2 * k + 1]
        if (not mark or tonumber(at) > mark) and occurrence.write(job) then
          redis.call('ZADD', dead_key, now, job)
          redis.call('HSET', reasons_key, job, 'expired: ' .. (now - tonumber(at)) ..
            ' ms after its occurrence, max_lateness ' .. limit .. ' ms')
          expired = expired + 1
          expired_here = expired_here + 1
        end
      end
      add_health(id, read_healths[at] or nil, fired_here, missed, expired_here, skipped, last_at)
      missed_total = missed_total + missed
      skipped_total = skipped_total + skipped
      if set_mark ~= '' then
        mark_adds[#mark_adds + 1] = set_mark
        mark_adds[#mark_adds + 1] = id
      end
      if next_ms == '' then
        pending_ends[#pending_ends + 1] = id
      else
        pending_adds[#pending_adds + 1] = next_ms
        pending_adds[#pending_adds + 1] = id
      end
    end
  end
end
write_all(function(a, b) redis.call('ZADD', due_key, unpack(due_adds, a, b)) end, due_adds)
write_all(function(a, b) redis.call('HSET', health_key, unpack(health_sets, a, b)) end, health_sets)
write_all(function(a, b) redis.call('ZADD', fired_key, 'GT', unpack(mark_adds, a, b)) end, mark_adds)
write_all(function(a, b) redis.call('ZADD', sched_due_key, unpack(pending_adds, a, b)) end,
  pending_adds)
for from = 1, #pending_ends, CHUNK do
  redis.call('ZREM', sched_due_key, unpack(pending_ends, from, math.min(from + CHUNK - 1, #pending_ends)))
end
local out = { created, expired, fenced, missed_total, skipped_total }
for _, v in ipairs(quarantined) do out[#out + 1] = v end
return out
