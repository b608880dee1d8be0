#!/usr/bin/env bash
# Worked example: delayed tasks moved from a ZSET into list queues, with "-delayed" lanes
# served ahead of the normal queues (Redis in Action 6.4.2), done by zdelay.
#
#   REDIS_PORT=<private redis port> ZDELAY=target/debug/zdelay bash run.sh
#
# Tasks to run now are RPUSHed onto queue:high / queue:medium / queue:low as before. Delayed
# tasks are `zdelay enqueue --dest <queue> --in <delay>` (or a ZADD into a raw source); when
# due they are RPUSHed onto queue:<queue>-delayed. A worker BLPOPs the six lists in priority
# order, each lane just before its queue. Then two daemons share one Redis without any lock.
source "$(dirname "$(readlink -f "$0")")/../lib.sh"

task() { printf '{"task":"%s","call":"%s","args":%s}' "$1" "$2" "$3"; }
name_of() { sed -n 's/.*"task":"\([^"]*\)".*/\1/p' <<<"$1"; }
lane() { rcli LRANGE "$1" 0 -1 | while IFS= read -r t; do name_of "$t"; done | paste -sd' ' -; }
lanes_filled() { llen_is queue:high-delayed 1 && llen_is queue:medium-delayed 2 && llen_is queue:low-delayed 1; }

section "zdelay run: routes high, medium, low (rpush, delayed_suffix \"-delayed\"), source delayed:low"
start_daemon

section "a task to run now: RPUSH onto its queue, as before"
for t in high:h-now medium:m-now-1 medium:m-now-2 low:l-now; do
    q=${t%%:*} name=${t#*:}
    rcli RPUSH "queue:$q" "$(task "$name" list_item '["sword",250]')" >/dev/null
    say "RPUSH queue:$q $name"
done

section "a task for later: zdelay enqueue --dest <queue> --in <delay>, or ZADD delayed:low"
zdelay enqueue --dest high --in 300ms --payload "$(task h-later list_item '["shield",90]')" >/dev/null
say "zdelay enqueue --dest high --in 300ms h-later"
# A route's jobs wait in its lane (beside its list): they leave in due order however late the
# mover.
zdelay enqueue --dest medium --id '{medium}:m-later-1' --in 300ms \
    --payload "$(task m-later-1 list_item '["bow",40]')" >/dev/null
say "zdelay enqueue --dest medium --id {medium}:m-later-1 --in 300ms m-later-1"
zdelay enqueue --dest medium --id '{medium}:m-later-2' --in 400ms \
    --payload "$(task m-later-2 list_item '["arrows",5]')" >/dev/null
say "zdelay enqueue --dest medium --id {medium}:m-later-2 --in 400ms m-later-2"
rcli ZADD delayed:low "$(ms_to_s $(($(redis_ms) + 350)))" "$(task l-later list_item '["rope",2]')" >/dev/null
say "ZADD delayed:low <now + 0.35 s> l-later"

section "due tasks land in the -delayed lanes, in due order"
wait_until 10 "every delayed task in its lane" lanes_filled
for q in high medium low; do say "queue:$q-delayed: $(lane "queue:$q-delayed")"; done

section "a worker: BLPOP queue:high-delayed queue:high queue:medium-delayed queue:medium queue:low-delayed queue:low"
for _ in $(seq 8); do
    mapfile -t popped < <(rcli BLPOP queue:high-delayed queue:high queue:medium-delayed \
        queue:medium queue:low-delayed queue:low 5)
    ((${#popped[@]} == 2)) || die "BLPOP returned nothing"
    say "${popped[0]} -> $(name_of "${popped[1]}")"
done
left=0
for q in high medium low; do left=$((left + $(rcli LLEN "queue:$q") + $(rcli LLEN "queue:$q-delayed"))); done
say "left in the six lists: $left"

section "two daemons on one Redis, no lock: each task is moved once"
FIRST=$DAEMON_PID FIRST_ADMIN=$ADMIN_PORT
BG_PIDS+=("$FIRST")
start_daemon
BULK=500
for ((n = 1; n <= BULK; n++)); do
    printf '{"dest":"medium","in":"300ms","payload":"{\\"task\\":\\"bulk-%d\\",\\"call\\":\\"list_item\\",\\"args\\":[]}"}\n' "$n"
done >"$WORK/bulk.jsonl"
zdelay enqueue --batch "$WORK/bulk.jsonl" >"$WORK/bulk.ids"
say "zdelay enqueue --batch: $(grep -c . "$WORK/bulk.ids") tasks for medium, due in 300 ms"
MEDIUM_JOBS=$(lane_key jobs medium queue:medium-delayed)
no_jobs_stored() { [[ $(rcli HLEN "$MEDIUM_JOBS") == 0 ]]; }
wait_until 20 "every task moved (no job left in medium's lane)" no_jobs_stored
rcli LRANGE queue:medium-delayed 0 -1 >"$WORK/bulk.txt"
say "queue:medium-delayed: $(wc -l <"$WORK/bulk.txt") tasks, $(sort -u "$WORK/bulk.txt" | wc -l) distinct"
by_first=$(ADMIN_PORT=$FIRST_ADMIN metric 'zdelay_jobs_moved_total{route="medium"}')
by_second=$(metric 'zdelay_jobs_moved_total{route="medium"}')
note "of the $BULK, the first daemon moved $((${by_first:-0} - 2)), the second ${by_second:-0}"

stop_daemon
DAEMON_PID=$FIRST
stop_daemon
BG_PIDS=()
say "both daemons stopped (SIGTERM, exit 0)"
say OK
