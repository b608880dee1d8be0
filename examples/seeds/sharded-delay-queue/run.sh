#!/usr/bin/env bash
# Worked example: the sharded delay set with a reclaim TTL and batch dequeue, done by zdelay.
#
#   REDIS_PORT=<private redis port> ZDELAY=target/debug/zdelay bash run.sh
#
# Producers ZADD 2,000 jobs into four delay-set shards (score = ready time in epoch seconds,
# spread over one second). zdelay moves ready members onto the list queue:jobs, one atomic
# script per batch and shard: no worker dequeues from the ZSETs, so there is no reclaim TTL
# to tune. The mover is killed with SIGKILL as soon as the first jobs arrive, more jobs
# become ready while it is down, and after a restart every job arrives exactly once.
# Then a worker that must survive its own crash takes jobs with BLMOVE into a processing
# list and acknowledges with LREM; it dies holding one job and finds it again on restart.
source "$(dirname "$(readlink -f "$0")")/../lib.sh"

SHARDS=4
JOBS=2000  # 500 per shard
LATE=4     # jobs that become ready while the mover is down
PROCESSING=queue:jobs:processing:w1

shard_of() { echo "delay_set_$(($1 % SHARDS))"; }
delay_sets_total() {
    local s total=0
    for ((s = 0; s < SHARDS; s++)); do total=$((total + $(rcli ZCARD "delay_set_$s"))); done
    echo "$total"
}

section "zdelay run: one raw source per delay-set shard, all routed to the list queue:jobs"
start_daemon

section "producers: ZADD delay_set_<n % $SHARDS> <ready time, epoch s> job-<n>"
# A steady stream: job-n is ready at base + n * SPREAD / JOBS ms.
SPREAD=1000
base=$(($(redis_ms) + 300))
declare -a args
for ((s = 0; s < SHARDS; s++)); do
    args=()
    for ((n = (s == 0 ? SHARDS : s); n <= JOBS; n += SHARDS)); do
        t=$((base + n * SPREAD / JOBS))
        printf -v score '%d.%03d' $((t / 1000)) $((t % 1000)) # epoch s, as ms_to_s
        args+=("$score" "job-$n")
    done
    added=$(rcli ZADD "delay_set_$s" "${args[@]}")
    say "ZADD delay_set_$s: $added jobs, ready from 0.3 s to 1.3 s from now"
done

section "the mover is killed (kill -9) as soon as the first jobs arrive"
wait_until 10 "the first jobs on queue:jobs" llen_at_least queue:jobs 1
kill9_daemon
# One atomic read of the list and the four sets (MULTI ... EXEC): its last five reply lines.
mapfile -t counts < <({
    echo MULTI
    echo LLEN queue:jobs
    for ((s = 0; s < SHARDS; s++)); do echo "ZCARD delay_set_$s"; done
    echo EXEC
} | rcli | tail -n $((SHARDS + 1)))
moved=${counts[0]} left=0
for ((s = 1; s <= SHARDS; s++)); do left=$((left + counts[s])); done
note "at the kill: $moved of $JOBS moved, $left still in the delay sets"
say "zdelay killed with SIGKILL after the first jobs arrived"
# A member is moved by one script that pushes it and removes it: at any instant it is on the
# list or in its set, once.
say "at the kill, on queue:jobs + still in the delay sets: $((moved + left)) of $JOBS"
late_ready=$(($(redis_ms) + 200))
for ((n = JOBS + 1; n <= JOBS + LATE; n++)); do
    rcli ZADD "$(shard_of "$n")" "$(ms_to_s "$late_ready")" "job-$n" >/dev/null
done
wait_until 10 "the late jobs' ready time" redis_time_past "$late_ready"
kept=0
for ((n = JOBS + 1; n <= JOBS + LATE; n++)); do
    if [[ -n $(rcli ZSCORE "$(shard_of "$n")" "job-$n") ]]; then kept=$((kept + 1)); fi
done
say "job-$((JOBS + 1))..job-$((JOBS + LATE)) ready while nothing moves: $kept of $LATE wait in their delay sets"

section "restart zdelay: it carries on where the killed one stopped"
start_daemon
total=$((JOBS + LATE))
wait_until 20 "$total jobs on queue:jobs" llen_at_least queue:jobs "$total"
rcli LRANGE queue:jobs 0 -1 >"$WORK/list.txt"
say "queue:jobs: $(wc -l <"$WORK/list.txt") members, $(sort -u "$WORK/list.txt" | wc -l) distinct; delay sets: $(delay_sets_total) left"

# A worker over one redis-cli session: take = BLMOVE from the right of queue:jobs onto its
# processing list (atomic: the job is always in one of the two lists), ack = LREM from it.
# Payloads here are single words, so each reply is one line; a nil reply is an empty line.
start_worker() { coproc WORKER { redis-cli -p "$REDIS_PORT"; }; }
stop_worker() {
    local pid=$WORKER_PID
    exec {WORKER[1]}>&-
    wait "$pid" || true
}
ask() {
    printf '%s\n' "$*" >&"${WORKER[1]}"
    IFS= read -r -t 5 REPLY <&"${WORKER[0]}" || die "no reply to: $*"
}
take() { ask BLMOVE queue:jobs "$PROCESSING" RIGHT LEFT 0.2; }
ack() {
    ask LREM "$PROCESSING" 1 "$1"
    [[ $REPLY == 1 ]] || die "ack of $1 removed $REPLY"
}
handle() { echo "$1" >>"$WORK/handled.txt"; }

section "worker w1: BLMOVE queue:jobs -> $PROCESSING, handle, LREM to acknowledge"
: >"$WORK/handled.txt"
start_worker
for i in 1 2 3; do
    take
    held=$REPLY
    handle "$held"
    if ((i < 3)); then ack "$held"; fi
done
stop_worker # w1 dies after handling its third job, before acknowledging it
say "w1 took 3 jobs, acknowledged 2, died holding 1: $PROCESSING has $(rcli LLEN "$PROCESSING")"

section "w1 restarts: first what its processing list still holds, then the queue"
start_worker
mapfile -t leftover < <(rcli LRANGE "$PROCESSING" 0 -1)
for job in "${leftover[@]}"; do
    handle "$job"
    ack "$job"
done
say "found ${#leftover[@]} unacknowledged job in $PROCESSING, handled it again, acknowledged it"
while take && [[ -n $REPLY ]]; do
    handle "$REPLY"
    ack "$REPLY"
done
stop_worker
handled=$(wc -l <"$WORK/handled.txt")
distinct=$(sort -u "$WORK/handled.txt" | wc -l)
repeated=$(sort "$WORK/handled.txt" | uniq -d)
say "handled $handled times: $distinct distinct jobs; handled twice: $([[ $repeated == "$held" ]] && echo "the job w1 died holding" || echo "${repeated:-none}")"
say "queue:jobs: $(rcli LLEN queue:jobs), $PROCESSING: $(rcli LLEN "$PROCESSING")"
for ((n = 1; n <= total; n++)); do echo "job-$n"; done | sort >"$WORK/expected.txt"
sort -u "$WORK/handled.txt" | cmp -s - "$WORK/expected.txt" || die "the handled jobs are not job-1..job-$total"
say "every job from job-1 to job-$total handled"

stop_daemon
say "zdelay stopped (SIGTERM, exit 0)"
say OK
