#!/usr/bin/env bash
# Worked example: recurring tasks on sorted sets run by many instances, with idempotency keys
# and retries with exponential backoff and jitter (Schedulinator), done by zdelay.
#
#   REDIS_PORT=<private redis port> ZDELAY=target/debug/zdelay bash run.sh
#
# The service the tasks call is a second Redis this script starts on a free loopback port
# (redis-server from PATH, or REDIS_SERVER): a call is an RPUSH onto its list `calls`, made
# through a remote `redis` sink, which is two-phase like a broker. Three zdelay instances
# share the shards; five tasks recur every 500 ms for 3 s while one instance stops halfway,
# and each occurrence is called once. Then the service refuses calls (OOM): one occurrence is
# retried with backoff and full jitter until it gives up, the next one is not held back, and
# the dead one is replayed. Last, the service is down for a while: occurrences wait without
# using up attempts, and all are called once it is back.
source "$(dirname "$(readlink -f "$0")")/../lib.sh"

SHARDS=4
scli() { redis-cli -p "$REDIS2_PORT" "$@"; } # the service's Redis
calls_of() { scli LRANGE calls 0 -1 | grep -cx "$1" || true; }
calls_of_is() { [[ $(calls_of "$1") == "$2" ]]; }
# The first whole second at least one second ahead, by Redis's clock.
next_second() { echo $((($(redis_ms) / 1000 + 2) * 1000)); }
# No schedule has a next occurrence left.
ended() {
    local out
    out=$(zdelay schedule list)
    [[ -z $out ]] || ! grep -vq "  next none" <<<"$out"
}
# Nothing due, scheduled or in flight in any shard (the total line of `zdelay stats`).
settled() {
    local out
    out=$(zdelay stats)
    grep -q '^total: 0 due now, 0 scheduled, 0 in flight,' <<<"$out"
}
schedules() { zdelay schedule list | sort; }
sink_line() {
    local out
    out=$(zdelay stats)
    grep '^sink endpoint ' <<<"$out"
}
sink_down_with() { [[ $(sink_line) == "sink endpoint (redis): down: "*"; $1 jobs waiting"* ]]; }
sink_up() { [[ $(sink_line) == "sink endpoint (redis): up "* ]]; }
# Some fields of `zdelay get ID`.
job_fields() {
    zdelay get "$1" -o json | grep -E '^  "(id|schedule|attempt|max_attempts|state|reason|waiting_for_sink)":' |
        sed 's/^ *//'
}
json_field() { sed -n "s/^  \"$1\": \"\{0,1\}\([^\",]*\).*/\1/p"; }

section "the service the tasks call: a second Redis; a call is an RPUSH onto its list calls"
start_redis2
export ZDELAY_SINKS__ENDPOINT__URL="redis://127.0.0.1:$REDIS2_PORT"
note "service: redis-server pid $REDIS2_PID on 127.0.0.1:$REDIS2_PORT"
say "service up; calls holds $(scli LLEN calls)"

section "many instances: zdelay run x3 on one namespace, the $SHARDS shards dealt among them"
for _ in 1 2 3; do start_instance; done
wait_until 10 "the three instances to share the shards" plan_is 3 1 "$SHARDS"
say "zdelay stats: 3 instances, each shard polled by exactly one of them"
zdelay stats | grep '^instance ' | while IFS= read -r line; do note "$line"; done

section "zadd schedules <time> task<n> becomes zdelay schedule set: every 500 ms, from T for 3 s"
# Two seconds more: the five sets and the list below show T as next only if they run before it.
T=$(($(next_second) + 2000))
T0=$T TNAME=T
for n in 1 2 3 4 5; do
    show_cmd "zdelay schedule set task$n --dest calls --every 500ms --start-at <T> --end-at <T+3000ms> --misfire catch_up --payload task$n" \
        zdelay schedule set "task$n" --dest calls --every 500ms --start-at "$T" --end-at $((T + 3000)) \
        --misfire catch_up --payload "task$n"
done
show_cmd "zdelay schedule list | sort" schedules

section "one instance stops halfway (SIGTERM): the two others poll its shards"
wait_until 10 "T+1500ms" redis_time_past $((T + 1500))
fired=$(instance_metric 1 'zdelay_schedule_occurrences_total{outcome="fired"}')
stop_instance 1
note "instance 2 fired ${fired:-0} occurrences before it stopped"
say "instance 2 stopped (SIGTERM, exit 0)"
wait_until 10 "the two others to take its shards" plan_is 2 1 "$SHARDS"
say "zdelay stats: 2 instances, each shard polled by exactly one of them"

section "every occurrence called once, whichever instance fired it"
wait_until 15 "the tasks' last occurrences" ended
wait_until 15 "every call settled" settled
for n in 1 2 3 4 5; do
    calls=$(calls_of "task$n")
    say "task$n: $calls calls"
    expect "calls of task$n" "$calls" 6
done
calls=$(scli LLEN calls)
say "calls holds $calls: 5 tasks x 6 occurrences (T, T+500ms, ..., T+2500ms)"
expect "calls" "$calls" 30
for i in 0 2; do
    note "instance $((i + 1)) fired $(instance_metric "$i" 'zdelay_schedule_occurrences_total{outcome="fired"}') occurrences"
done
show_cmd "zdelay schedule list | sort" schedules

section "the service refuses calls (OOM): retries with exponential backoff and full jitter"
show_cmd "redis-cli -p <service> CONFIG SET maxmemory 1" scli CONFIG SET maxmemory 1
R=$(next_second)
T0=$R TNAME=R
show_cmd "zdelay schedule set report --dest calls --every 3s --start-at <R> --end-at <R+6000ms> --max-attempts 4 --payload report" \
    zdelay schedule set report --dest calls --every 3s --start-at "$R" --end-at $((R + 6000)) \
    --max-attempts 4 --payload report
# Follow the first occurrence, a job of its own, until it dies: each refused call rewrites its
# attempt count and its due time (the backoff); the scheduled due of its idempotency key
# (HGET zdelay:{<tag>}:s<shard>:scheduled <id>, in its spread shard: "<scheduled due>
# <fencing token of its last claim>")
# stays.
occ="{report}:$R"
seen=0 keys=()
deadline=$((SECONDS + 15))
while :; do
    ((SECONDS < deadline)) || die "the occurrence $occ did not die within 15 s"
    if job=$(zdelay get "$occ" -o json 2>/dev/null); then
        state=$(json_field state <<<"$job")
        attempt=$(json_field attempt <<<"$job")
        shard=$(json_field shard <<<"$job")
        key=$(rcli HGET "$(spread_key scheduled "$shard" "$SHARDS")" "$occ")
        key=${key%% *}
        [[ -z $key ]] || keys+=("$key")
        [[ $state == dead ]] && break
        if [[ $state == scheduled && ${attempt:-0} -gt $seen ]]; then
            seen=$attempt
            due=$(json_field due <<<"$job")
            note "call $attempt refused; the next one at R+$((due - R))ms (drawn from [0, $((200 << (attempt - 1)))] ms after the failure)"
        fi
    fi
    sleep 0.02
done
show_cmd "zdelay get {report}:<R+0ms>   (fields id, schedule, attempt, max_attempts, state, reason)" \
    job_fields "$occ"
expect "attempts of the dead occurrence" "$(zdelay get "$occ" -o json | json_field attempt)" 4
schedule_id=$(zdelay get "$occ" -o json | json_field schedule)
distinct=$(printf '%s\n' "${keys[@]}" | sort -u | relative "$R" R | paste -sd' ' -)
say "scheduled due kept while it was retried (zdelay:{<tag>}:s<shard>:scheduled): $distinct"
say "so each of its calls had the idempotency key $schedule_id:$distinct (<schedule id>:<occurrence ms>)"
expect "scheduled dues kept while retried" "$distinct" "<R+0ms>"
say "(Kafka, AMQP and NATS messages carry it as zdelay-id / message id; a Redis list gets the payload only)"
rejected=$(scli INFO commandstats | tr -d '\r' | sed -n 's/^cmdstat_rpush:.*rejected_calls=\([0-9]*\).*/\1/p')
say "the service refused ${rejected:-0} RPUSH calls (INFO commandstats, rejected_calls)"
expect "refused calls" "${rejected:-0}" 4
expect "report's next occurrence" "$(zdelay schedule get report --json | json_field next_ms)" $((R + 3000))
# The recipe pushes a task that used up its retries to "its time + the worst-case retry time";
# here the dead occurrence is a job of its own, and the schedule stays on its grid.
show_cmd "zdelay schedule get report | sed 's/[0-9]*ms late/<n>ms late/'" eval "zdelay schedule get report | sed 's/[0-9]*ms late/<n>ms late/'"
show_cmd "redis-cli -p <service> CONFIG SET maxmemory 0" scli CONFIG SET maxmemory 0
wait_until 15 "the next occurrence's call" calls_of_is report 1
say "the next occurrence, R+3000ms, went out as planned: calls holds report x$(calls_of report)"
show_cmd "zdelay dead list | sed 's/  died [^ ]*//'" eval "zdelay dead list | sed 's/  died [^ ]*//'"
show_cmd "zdelay dead replay --id {report}:<R+0ms>" zdelay dead replay --id "$occ"
wait_until 15 "the replayed call" calls_of_is report 2
wait_until 15 "report's last occurrence" ended
wait_until 15 "every call settled" settled
dead=$(zdelay dead list 2>/dev/null | grep -c . || true)
say "calls holds report x$(calls_of report); dead jobs left: $dead"
expect "dead jobs left" "$dead" 0

section "the service is down: occurrences wait for it, no attempt used up"
stop_redis2
say "service stopped (SIGTERM)"
P=$(next_second)
T0=$P TNAME=P
show_cmd "zdelay schedule set ping --dest calls --every 500ms --start-at <P> --end-at <P+2000ms> --payload ping" \
    zdelay schedule set ping --dest calls --every 500ms --start-at "$P" --end-at $((P + 2000)) --payload ping
wait_until 15 "the sink down with 4 occurrences waiting" sink_down_with 4
note "$(sink_line)"
say "zdelay stats: sink endpoint (redis): down; 4 jobs waiting"
show_cmd "zdelay get {ping}:<P+0ms>   (fields id, schedule, attempt, state, waiting_for_sink)" \
    job_fields "{ping}:$P"
used=$(zdelay get "{ping}:$P" -o json | json_field attempt | grep . || echo 0)
say "attempts used: $used"
expect "attempts used while the service was down" "$used" 0
start_redis2
note "service: redis-server pid $REDIS2_PID on 127.0.0.1:$REDIS2_PORT"
say "service back on the same port, empty"
wait_until 15 "the four pings" calls_of_is ping 4
wait_until 15 "every call settled" settled
wait_until 15 "the sink up" sink_up
calls=$(scli LLEN calls)
say "calls holds $calls: ping x$(calls_of ping); sink endpoint (redis): up"
expect "calls after the restart" "$calls" 4

for i in 0 2; do stop_instance "$i"; done
stop_redis2
say "instances and service stopped (SIGTERM, exit 0)"
say OK
