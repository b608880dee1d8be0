#!/usr/bin/env bash
# Worked example: a distributed scheduled queue (cron format, Lua for atomicity, several
# polling workers), done by zdelay.
#
#   REDIS_PORT=<private redis port> ZDELAY=target/debug/zdelay bash run.sh
#
# Planning: cron expressions with seconds, previewed by the daemon's own code. Coordinating:
# each schedule keeps one pending occurrence; one fenced script turns it into a job and writes
# the next, so nothing is computed hours ahead and no two workers fire the same occurrence.
# Execution: three zdelay daemons share the shards and the route's lane (where its schedules
# live and fire), two on each; one is killed with SIGKILL
# mid-run; two consumers BRPOP the queue. Thirteen schedules fire 63 occurrences in 5 s, and
# each is consumed once. Then no daemon runs while three occurrences of each of three
# schedules pass: a daemon that starts later applies each one's misfire policy. Last, a
# weekday schedule in Europe/Paris is updated, paused, resumed and deleted.
source "$(dirname "$(readlink -f "$0")")/../lib.sh"

SHARDS=4
QUEUE=queue:cron
ids() {
    for n in $(seq -w 1 12); do echo "job-$n"; done
    echo job-even
}
# No schedule has a next occurrence left.
ended() {
    local out
    out=$(zdelay schedule list)
    [[ -z $out ]] || ! grep -vq "  next none" <<<"$out"
}
# Nothing due or scheduled in any shard (the total line of `zdelay stats`).
settled() {
    local out
    out=$(zdelay stats)
    grep -q '^total: 0 due now, 0 scheduled, 0 in flight,' <<<"$out"
}
consumed() { cat "$WORK"/consumer-* 2>/dev/null | wc -l; }
consumed_is() { [[ $(consumed) == "$1" ]]; }
# A consumer: BRPOP the queue until it pops the word stop; one job a line in $WORK/consumer-NAME.
consume() {
    local reply
    : >"$WORK/consumer-$1"
    while :; do
        mapfile -t reply < <(rcli BRPOP "$QUEUE" 1)
        ((${#reply[@]} == 2)) || continue
        [[ ${reply[1]} != stop ]] || break
        printf '%s\n' "${reply[1]}" >>"$WORK/consumer-$1"
    done
}

section "planning: the cron format with seconds (6 fields), previewed by the daemon's code, no Redis"
show_cmd "zdelay schedule preview --cron '*/20 * * * * *' --from 2030-01-01T00:00:00Z --count 4" \
    zdelay schedule preview --cron '*/20 * * * * *' --from 2030-01-01T00:00:00Z --count 4
show_cmd "zdelay schedule preview --cron '0 30 9 * * 1-5' --tz Europe/Paris --from 2030-03-29T00:00:00Z --count 3" \
    zdelay schedule preview --cron '0 30 9 * * 1-5' --tz Europe/Paris --from 2030-03-29T00:00:00Z --count 3

section "the workers: zdelay run x3, each of the $SHARDS shards and the route's lane polled by two of them"
for _ in 1 2 3; do start_instance; done
wait_until 10 "two daemons on every shard and lane" plan_is 3 2 "$SHARDS"
say "zdelay stats: 3 instances, each shard and lane polled by 2 of them"
zdelay stats | grep '^instance ' | while IFS= read -r line; do note "$line"; done

section "the consumers: two of them BRPOP $QUEUE"
consume c1 </dev/null >/dev/null 2>&1 &
BG_PIDS+=("$!")
consume c2 </dev/null >/dev/null 2>&1 &
BG_PIDS+=("$!")
say "consumers c1 and c2 started"

section "ZADD cron:queue <time> <job> becomes a schedule: 13 of them, from T (an even second) for 5 s"
# T: an even second at least 1.5 s ahead by Redis's clock.
T=$((($(redis_ms) + 1500) / 2000 * 2000 + 2000))
T0=$T TNAME=T
for id in $(ids); do
    cron='* * * * * *'
    [[ $id != job-even ]] || cron='*/2 * * * * *'
    printf '{"id":"%s","dest":"jobs","cron":"%s","payload":"%s","start_at":%d,"end_at":%d,"misfire":"catch_up"}\n' \
        "$id" "$cron" "$id" "$T" $((T + 5000))
done >"$WORK/schedules.jsonl"
show_cmd "head -n 1 schedules.jsonl; tail -n 1 schedules.jsonl" \
    eval "head -n 1 '$WORK/schedules.jsonl'; tail -n 1 '$WORK/schedules.jsonl'"
show_cmd "zdelay schedule set --batch schedules.jsonl | sort" \
    eval "zdelay schedule set --batch '$WORK/schedules.jsonl' | sort"
# The route's schedules, their pending occurrences and its jobs live in its lane.
SCHED_DUE=$(lane_key sched_due jobs "$QUEUE")
pending=$(rcli ZCARD "$SCHED_DUE") jobs=$(rcli HLEN "$(lane_key jobs jobs "$QUEUE")")
(($(redis_ms) < T)) || die "the schedules were set after T: machine too slow for this timeline"
say "pending occurrences (ZCARD zdelay:{<tag>}:sched_due:jobs, the route's lane): $pending, one per schedule; jobs stored ahead of time: $jobs"
expect "pending occurrences" "$pending" 13
expect "jobs stored ahead" "$jobs" 0

section "a worker dies (kill -9) at T+2200ms: the other daemon on each of its shards and lanes carries on"
wait_until 10 "T+2200ms" redis_time_past $((T + 2200))
# Its count just before the kill: nothing is due between T+2s and T+3s.
fired_by_killed=$(instance_metric 0 'zdelay_schedule_occurrences_total{outcome="fired"}')
kill9_instance 0
say "instance 1 killed with SIGKILL"
wait_until 10 "its registration to lapse and the shards to be dealt again" plan_is 2 2 "$SHARDS"
say "zdelay stats: 2 instances, each shard and lane polled by 2 of them"

section "each occurrence fired once, by one fenced script, and consumed once"
wait_until 15 "the schedules' last occurrences" ended
wait_until 15 "every occurrence moved" settled
wait_until 15 "the consumers to take all 63" consumed_is 63
rcli LPUSH "$QUEUE" stop stop >/dev/null
wait_until 10 "the consumers to stop" eval '! alive "${BG_PIDS[0]}" && ! alive "${BG_PIDS[1]}"'
BG_PIDS=()
while read -r count id; do
    say "$id: consumed $count times"
    if [[ $id == job-even ]]; then expect "$id consumed" "$count" 3; else expect "$id consumed" "$count" 5; fi
done < <(cat "$WORK"/consumer-* | sort | uniq -c)
left=$(rcli LLEN "$QUEUE")
say "consumed $(consumed) = 12 schedules x 5 (T, T+1s, ..., T+4s) + job-even x 3 (T, T+2s, T+4s); $QUEUE holds $left"
expect "left on $QUEUE" "$left" 0
note "c1 took $(wc -l <"$WORK/consumer-c1"), c2 took $(wc -l <"$WORK/consumer-c2")"
fired=("${fired_by_killed:-0}")
for i in 1 2; do fired+=("$(instance_metric "$i" 'zdelay_schedule_occurrences_total{outcome="fired"}')"); done
note "fired by instance 1 (killed), 2, 3: ${fired[*]}"
total=$((fired[0] + fired[1] + fired[2]))
say "fired by the three daemons together (zdelay_schedule_occurrences_total): $total"
expect "fired" "$total" 63

section "no worker runs for a while: what was missed follows each schedule's misfire policy"
for i in 1 2; do stop_instance "$i"; done
say "the two daemons left stopped (SIGTERM, exit 0); none runs now"
# M: a whole second at least one second ahead. Occurrences M, M+1s, M+2s all pass unseen.
M=$((($(redis_ms) / 1000 + 2) * 1000))
T0=$M TNAME=M
for policy in coalesce skip catch_up; do
    show_cmd "zdelay schedule set missed-$policy --dest jobs --cron '* * * * * *' --start-at <M> --end-at <M+3000ms> --misfire $policy --payload missed-$policy" \
        zdelay schedule set "missed-$policy" --dest jobs --cron '* * * * * *' --start-at "$M" \
        --end-at $((M + 3000)) --misfire "$policy" --payload "missed-$policy"
done
(($(redis_ms) < M)) || die "the schedules were set after M: machine too slow for this timeline"
wait_until 10 "M+2000ms, the third occurrence due" redis_time_past $((M + 2000))
start_instance
say "a daemon starts after M+2000ms, with three occurrences of each schedule missed"
wait_until 15 "the missed occurrences handled" ended
wait_until 15 "every occurrence moved" settled
declare -A want=([coalesce]=1 [skip]=0 [catch_up]=3)
for policy in coalesce skip catch_up; do
    got=$(rcli LRANGE "$QUEUE" 0 -1 | grep -cx "missed-$policy" || true)
    say "missed-$policy: delivered $got of 3"
    expect "missed-$policy delivered" "$got" "${want[$policy]}"
done
fired=$(instance_metric 3 'zdelay_schedule_occurrences_total{outcome="fired"}')
say "the daemon fired $fired occurrences"
expect "fired after the pause" "$fired" 4
stop_instance 3
say "daemon stopped (SIGTERM, exit 0)"

section "one pending occurrence per schedule, nothing planned hours ahead: update, pause, resume, delete"
T0=""
show_cmd "zdelay schedule set standup --dest jobs --cron '0 30 9 * * 1-5' --tz Europe/Paris --start-at 2030-03-29T00:00:00Z --payload standup" \
    zdelay schedule set standup --dest jobs --cron '0 30 9 * * 1-5' --tz Europe/Paris \
    --start-at 2030-03-29T00:00:00Z --payload standup
show_cmd "redis-cli ZRANGE zdelay:{<tag>}:sched_due:jobs 0 -1 WITHSCORES" \
    rcli ZRANGE "$SCHED_DUE" 0 -1 WITHSCORES
show_cmd "zdelay schedule set standup --dest jobs --cron '0 0 10 * * 1-5' --tz Europe/Paris --start-at 2030-03-29T00:00:00Z --payload standup" \
    zdelay schedule set standup --dest jobs --cron '0 0 10 * * 1-5' --tz Europe/Paris \
    --start-at 2030-03-29T00:00:00Z --payload standup
show_cmd "zdelay schedule pause standup" zdelay schedule pause standup
show_cmd "zdelay schedule get standup" zdelay schedule get standup
show_cmd "zdelay schedule resume standup" zdelay schedule resume standup
show_cmd "zdelay schedule delete standup" zdelay schedule delete standup
show_cmd "zdelay schedule get standup" zdelay schedule get standup

say OK
