-- Included after their fences by fire_schedules and fire_schedules_lane: firing is the same in
-- a spread shard and in a route lane (the arguments, the bound, the marks, the misfire
-- decisions the caller made); only how an occurrence is written as a job differs, and a lane
-- may push an occurrence that is due straight onto its list. The includer names its keys
-- (due_key, dead_key, reasons_key, limit_key, schedules_key, env_key, sched_due_key,
-- fired_key, quarantine_key, health_key), FIRST (the index of the first schedule's arguments)
-- and defines:
--   split(envelope): the payload and meta an occurrence carries, or nil and why the envelope
--     cannot be fired;
--   write_job(job, payload, meta): writes it as a job (false when the id is taken: written
--     already, waiting or dead); waiting(job, payload): after a job was written due;
--   direct: nil, or where due occurrences go at once: { push = 'LPUSH' | 'RPUSH', list = key,
--     now = ms (the push's now), max_payload = bytes, bounds = lateness bucket bounds, ms }.
-- An occurrence goes straight to the list (no job written, no move) only when nothing already
-- due waits in the lane before it (its due set's head is later than now: the list's order is
-- the due order either way), it is due, within its max lateness and not over the largest
-- payload; any other waits in due as a job, which the lane's move delivers or sends to dead.

local MAX_OCCURRENCES = 1000
local now = tonumber(ARGV[2])
-- Where each schedule's arguments start, and the bound, before anything is written.
local starts, total, i = {}, 0, FIRST
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
-- Occurrences pushed straight onto the list, in the order they are found (sorted by due, then
-- job id, before the push, as the lane's move orders its jobs).
local pushing = false
if direct then
  local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')[2]
  pushing = not head or tonumber(head) > direct.now
end
local push_n, push_due, push_job, push_payload, push_meta, push_limit = 0, {}, {}, {}, {}, {}
local missed_total, skipped_total = 0, 0
-- A schedule's health record: "<fired> <missed> <expired> <skipped by calendar> <last fired ms>
-- <its occurrence ms>" (the last two empty as "-" until it first fires). One field per
-- schedule, six numbers: written here, in the step that decides the occurrences, so the counts
-- are exact whichever daemon fires and whatever crashes.
-- A ms time as the record keeps it: whole digits, or "-" for none.
local function whole(v)
  if v == '-' then return '-' end
  return string.format('%d', tonumber(v))
end
local function add_health(id, old, fired, missed, expired_n, skipped, last_at)
  if fired + missed + expired_n + skipped == 0 then return end
  local h = { 0, 0, 0, 0, '-', '-' }
  if old then
    local a, b, c, d, e, f = string.match(old, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+)')
    if a then
      h = { a, b, c, d, e, f }
    else
      local k = 1
      for word in string.gmatch(old, '%S+') do
        if k <= 6 then h[k] = word end
        k = k + 1
      end
    end
  end
  -- Concatenated, not formatted (a call writes hundreds of these): Lua prints a count below
  -- 10^14 whole; the times go through whole().
  local last, of = h[5], h[6]
  if last_at then last, of = now, last_at end
  health_sets[#health_sets + 1] = id
  health_sets[#health_sets + 1] = ((tonumber(h[1]) or 0) + fired) .. ' '
    .. ((tonumber(h[2]) or 0) + missed) .. ' ' .. ((tonumber(h[3]) or 0) + expired_n) .. ' '
    .. ((tonumber(h[4]) or 0) + skipped) .. ' ' .. whole(last) .. ' ' .. whole(of)
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
    local payload, meta = nil, 'no envelope stored for its occurrences'
    if envelope then payload, meta = split(envelope) end
    if not payload then
      quarantine(id, meta)
    else
      local mark = read_marks[at] and tonumber(read_marks[at])
      local fired_here, expired_here, last_at = 0, 0, nil
      local limit_ms = tonumber(limit)
      for k = 0, deliver - 1 do
        local job, at = ARGV[first_deliver + 3 * k], ARGV[first_deliver + 3 * k + 1]
        local due = ARGV[first_deliver + 3 * k + 2]
        local at_ms = tonumber(at)
        if not mark or at_ms > mark then
          local due_ms = tonumber(due)
          local wrote = false
          if pushing and due_ms <= direct.now and (not limit_ms or direct.now - due_ms <= limit_ms)
            and #payload <= direct.max_payload then
            push_n = push_n + 1
            push_due[push_n], push_job[push_n] = due_ms, job
            push_payload[push_n], push_meta[push_n], push_limit[push_n] = payload, meta, limit
            wrote = true
          elseif write_job(job, payload, meta) then
            due_adds[#due_adds + 1] = due
            due_adds[#due_adds + 1] = job
            if limit ~= '' then redis.call('HSET', limit_key, job, limit) end
            waiting(job, payload)
            created = created + 1
            wrote = true
          end
          if wrote then
            fired_here = fired_here + 1
            last_at = at_ms
          end
        end
      end
      for k = 0, n_expired - 1 do
        local job, at = ARGV[first_expired + 2 * k], ARGV[first_expired + 2 * k + 1]
        if (not mark or tonumber(at) > mark) and write_job(job, payload, meta) then
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
-- The occurrences due now, onto the list in one push. A push Redis refuses (a key of another
-- type, out of memory) writes nothing: they are written as jobs instead, and the lane's move
-- says what became of them (a wrong type sends them to dead, as any job of the route).
local pushed, push_late_max, push_buckets = 0, 0, {}
if push_n > 0 then
  local order = {}
  local sorted = true
  for k = 1, push_n do
    order[k] = k
    if k > 1 and (push_due[k] < push_due[k - 1]
      or (push_due[k] == push_due[k - 1] and push_job[k] < push_job[k - 1])) then
      sorted = false
    end
  end
  if not sorted then
    table.sort(order, function(x, y)
      if push_due[x] ~= push_due[y] then return push_due[x] < push_due[y] end
      return push_job[x] < push_job[y]
    end)
  end
  local payloads = {}
  for k = 1, push_n do payloads[k] = push_payload[order[k]] end
  local res = redis.pcall(direct.push, direct.list, unpack(payloads))
  if type(res) == 'table' and res.err then
    for k = 1, push_n do
      local x = order[k]
      local job = push_job[x]
      if write_job(job, push_payload[x], push_meta[x]) then
        due_adds[#due_adds + 1] = push_due[x]
        due_adds[#due_adds + 1] = job
        if push_limit[x] ~= '' then redis.call('HSET', limit_key, job, push_limit[x]) end
        waiting(job, push_payload[x])
        created = created + 1
      end
    end
  else
    pushed = push_n
    local bounds = direct.bounds
    for b = 1, #bounds + 1 do push_buckets[b] = 0 end
    -- Bucket b holds lateness in (bound b - 1, bound b]; the last one is over every bound.
    -- Found by bisection: a bench's fine bounds are hundreds.
    local top = #bounds + 1
    for k = 1, push_n do
      local late = direct.now - push_due[k]
      if late > push_late_max then push_late_max = late end
      local lo, hi = 1, top
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if late <= bounds[mid] then hi = mid else lo = mid + 1 end
      end
      push_buckets[lo] = push_buckets[lo] + 1
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
local out = { created, expired, fenced, missed_total, skipped_total, pushed,
  direct and direct.now or 0, push_late_max, #push_buckets }
for _, n in ipairs(push_buckets) do out[#out + 1] = n end
for _, v in ipairs(quarantined) do out[#out + 1] = v end
return out
