-- claim_slots: an instance's heartbeat. It registers (or stays registered), then computes the
-- plan of who polls what for every live instance and writes it, returning its own part.
-- Every target (an envelope shard or a raw source) has per_shard slots "<target>#<k>". The
-- plan is a function of the live instances and their sources only, so whoever runs it finds
-- the same: slots dealt round-robin over the instances in id order (at most
-- ceil(slots / live instances) each; the two slots of a target on two instances; with one
-- instance the second slot stays unassigned, one instance polling twice being one poller).
-- A raw source only some instances are configured with is dealt among those.
-- An instance whose registration lapsed (it stopped renewing for a lease) is dropped with its
-- slots. A slot moved to another instance is polled by both until the old holder's next
-- heartbeat: harmless, every script is atomic and two-phase settles are fenced.
-- Identity: an instance id is stable across restarts (poller.instance_id); each process
-- registers with a nonce of its own. A process's first heartbeat takes over a live
-- registration of its id held by another nonce (its previous life, killed before it could
-- hand back): it polls that life's slots at once, and the registration remembers whom it
-- was taken from. If that other process is in fact alive, its next heartbeat finds the
-- registration taken from it and takes it back; the newcomer then finds its id held by a
-- process that did not give it up, and refuses. Two live processes with one id never
-- take turns: the one that has been running keeps the id.
-- KEYS[1] instances HASH {zdelay}:instances         id -> "<registration expiry ms> <last heartbeat ms> <nonce> <nonce it was taken from, or -> <version>"
-- KEYS[2] slots     HASH {zdelay}:slots             "<target>#<k>" -> instance id
-- KEYS[3] sources   HASH {zdelay}:instance_sources  id -> its raw sources' targets, "\n"-separated
-- KEYS[4] plan      HASH {zdelay}:plan              "sig" -> SHA-1 of what the plan was made of (the
--                                                    slots per target, the shard count, the live
--                                                    instances and their targets), id -> that
--                                                    instance's targets, "\n"-separated: while the
--                                                    inputs stay the same the plan is not made again
--                                                    (with 64 lane groups that was most of the call)
-- ARGV[1] this instance's id; ARGV[2] registration lifetime ms (the slot lease)
-- ARGV[3] slots per target (1 or 2); ARGV[4] the shard count (on storage layout 2: the spread shards)
-- ARGV[5] this process's nonce (new at every start)
-- ARGV[6] its standing: "new" (no heartbeat yet), "held" (renewed within a lease), "lost"
--   (registered once, but no renewal for a lease)
-- ARGV[7] this process's zdelay version (what `zdelay stats` shows, and what an upgrade of the
--   namespace's storage layout checks)
-- ARGV[8] this instance's raw source and route lane group targets ("source:<key>",
--   "lanes:<group>:<hash>"), "\n"-separated, as one argument ("" for none)
-- Returns: { registration, live instances, this instance's targets (each once) "\n"-separated };
--   registration 0 = registered or renewed, 1 = took over a live registration of this id
--   (a previous life), 2 = took it back from a newer process with this id (which will
--   refuse), -1 = refused: another live process holds this id (then nothing else is
--   returned and nothing is written)
-- Re-run safety: yes; a second run renews and finds the same plan.
local instances_key, slots_key, sources_key = KEYS[1], KEYS[2], KEYS[3]
local me, ttl, per, shards = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local nonce, standing = ARGV[5], ARGV[6]
-- @include clock
-- Redis TIME, never a test clock: daemons' registrations live in real time, so moving a
-- test clock expires none.
local now = math.floor(clock_us() / 1000)

local registration, taken_from = 0, '-'
local current = redis.call('HGET', instances_key, me)
if current then
  local expiry, holder, from = string.match(current, '^(%d+) %d+ ?(%S*) ?(%S*)')
  if tonumber(expiry or 0) > now and holder ~= nonce then
    if standing == 'held' and from == nonce then
      -- A newer process took our registration while we are alive: ours again.
      registration = 2
    elseif standing == 'new' then
      registration = 1
      if holder ~= '' then taken_from = holder end
    else
      return { -1 }
    end
  elseif holder == nonce and from ~= '' then
    -- Keep whom we took it from: if that process is alive after all, it takes it back.
    taken_from = from
  end
end
redis.call('HSET', instances_key, me, string.format('%d %d %s %s %s', now + ttl, now, nonce, taken_from, ARGV[7]))
local plan_key = KEYS[4]
local my_list = ARGV[8] or ''
if my_list == '' then
  redis.call('HDEL', sources_key, me)
elseif redis.call('HGET', sources_key, me) ~= my_list then
  redis.call('HSET', sources_key, me, my_list)
end

-- Live instances, in id order; forget lapsed ones.
local live = {}
local registered = redis.call('HGETALL', instances_key)
for i = 1, #registered, 2 do
  local expiry = tonumber(string.match(registered[i + 1], '^(%d+)'))
  if expiry and expiry > now then
    live[#live + 1] = registered[i]
  else
    redis.call('HDEL', instances_key, registered[i])
    redis.call('HDEL', sources_key, registered[i])
  end
end
table.sort(live)

-- Targets, and who may poll each: every live instance polls shards; sources by config.
local targets, pollers_of = {}, {}
for s = 0, shards - 1 do
  local name = 'shard:' .. s
  targets[#targets + 1] = name
  pollers_of[name] = live
end
local lists = {}
local inputs = { per, shards }
for _, id in ipairs(live) do
  lists[id] = redis.call('HGET', sources_key, id) or ''
  inputs[#inputs + 1] = id
  inputs[#inputs + 1] = lists[id]
end
-- The same inputs make the same plan, written already: answer from it.
local sig = redis.sha1hex(table.concat(inputs, '\0'))
if redis.call('HGET', plan_key, 'sig') == sig then
  return { registration, #live, redis.call('HGET', plan_key, me) or '' }
end
local source_pollers = {}
for _, id in ipairs(live) do
  for name in string.gmatch(lists[id], '[^\n]+') do
    if not source_pollers[name] then source_pollers[name] = {} end
    table.insert(source_pollers[name], id)
  end
end
local source_names = {}
for name, ids in pairs(source_pollers) do
  table.sort(ids)
  pollers_of[name] = ids
  source_names[#source_names + 1] = name
end
table.sort(source_names)

local held = {}
local flat = redis.call('HGETALL', slots_key)
for i = 1, #flat, 2 do
  held[flat[i]] = flat[i + 1]
end

-- Targets every live instance polls (all shards, and the sources every instance has), slot
-- by slot in target order, round-robin over the instances: counts differ by one at most,
-- and a target's two slots are consecutive, so they land on two instances.
local plan = {}
local function assign(name, k, id)
  -- One instance polling a target twice is one poller: leave the second slot unassigned.
  if k == 0 or plan[name .. '#0'] ~= id then plan[name .. '#' .. k] = id end
end
for _, name in ipairs(source_names) do targets[#targets + 1] = name end
local everywhere, partial = {}, {}
for _, name in ipairs(targets) do
  if #pollers_of[name] == #live then
    everywhere[#everywhere + 1] = name
  else
    partial[#partial + 1] = name
  end
end
local j = 0
for _, name in ipairs(everywhere) do
  for k = 0, per - 1 do
    assign(name, k, live[(j % #live) + 1])
    j = j + 1
  end
end
-- A source only some instances have (configs differ, e.g. mid-rollout): round-robin over them.
for i, name in ipairs(partial) do
  local ids = pollers_of[name]
  for k = 0, per - 1 do
    assign(name, k, ids[((i - 1 + k) % #ids) + 1])
  end
end

-- Write what changed; drop slots no longer planned.
for slot, holder in pairs(held) do
  if not plan[slot] then redis.call('HDEL', slots_key, slot) end
end
local writes = {}
for slot, id in pairs(plan) do
  if held[slot] ~= id then
    writes[#writes + 1] = slot
    writes[#writes + 1] = id
  end
end
if #writes > 0 then redis.call('HSET', slots_key, unpack(writes)) end

-- Each instance's targets (each once), kept with the inputs they were made of.
local of, seen = {}, {}
for slot, id in pairs(plan) do
  local name = string.match(slot, '^(.*)#%d+$')
  if not seen[id .. '\n' .. name] then
    seen[id .. '\n' .. name] = true
    if not of[id] then of[id] = {} end
    table.insert(of[id], name)
  end
end
local cached = { 'sig', sig }
for id, names in pairs(of) do
  cached[#cached + 1] = id
  cached[#cached + 1] = table.concat(names, '\n')
end
redis.call('DEL', plan_key)
redis.call('HSET', plan_key, unpack(cached))
return { registration, #live, table.concat(of[me] or {}, '\n') }
