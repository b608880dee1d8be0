#!/usr/bin/env bash
# Worked example: the scheduler built from three primitives — enqueue, remove, get_expired —
# done by zdelay.
#
#   REDIS_PORT=<private redis port> ZDELAY=target/debug/zdelay bash run.sh
#
# enqueue is a ZADD into the raw source scheduled_objects (or `zdelay enqueue --at`), remove
# is a ZREM (or `zdelay cancel`), and get_expired is what the daemon does: at each object's
# time it moves it onto queue:expired, where a consumer blocks in BRPOP. There is no polling
# worker and no lock by score; keyspace notifications and enqueue wake-ups make the move
# happen at the object's millisecond, not at the next tick of a polling interval.
source "$(dirname "$(readlink -f "$0")")/../lib.sh"

# Shows a command as DISPLAY (placeholders instead of timestamps), runs it, prints its
# standard output and its exit code; its stderr follows as "# " lines (it names paths).
show() {
    local display=$1 out rc=0 line
    shift
    say "\$ $display"
    out=$("$@" 2>"$WORK/stderr") || rc=$?
    [[ -z $out ]] || say "$out"
    while IFS= read -r line; do note "stderr: $line"; done <"$WORK/stderr"
    say "(exit $rc)"
}

section "keyspace notifications for sorted sets, so a ZADD wakes zdelay"
flags=$(rcli CONFIG GET notify-keyspace-events | sed -n 2p)
for f in K z; do [[ $flags == *"$f"* ]] || flags+=$f; done
[[ $(rcli CONFIG SET notify-keyspace-events "$flags") == OK ]] || die "CONFIG SET notify-keyspace-events"
say "notify-keyspace-events includes K and z"

section "zdelay run: raw source scheduled_objects and the route expired -> queue:expired"
start_daemon
wait_until 10 "zdelay's keyspace subscription" has_subscriber __keyspace@0__:scheduled_objects
wait_until 10 "zdelay's enqueue wake-up subscription" has_subscriber zdelay:wake
say "zdelay listens on __keyspace@0__:scheduled_objects and zdelay:wake"

# The consumer: one redis-cli that blocks in BRPOP, then reads Redis TIME right after each pop.
EXPECTED=4
for _ in $(seq "$EXPECTED"); do printf 'BRPOP queue:expired 10\nTIME\n'; done |
    redis-cli -p "$REDIS_PORT" >"$WORK/consumed.txt" &
CONSUMER=$!
BG_PIDS+=("$CONSUMER")

# The timeline, relative to T (1.5 s from now, by Redis's clock: time for the removals). Removed objects are due
# before a later object of the same source or shard, which is delivered: had they not been
# removed, they would have arrived first.
T=$(($(redis_ms) + 1500))
declare -A DUE=([obj-a]=$T [obj-c]=$((T + 300)) [obj-b]=$((T + 600)) [obj-d]=$((T + 900))
    [obj-e]=$((T + 1200)) [obj-f]=$((T + 1500)))
rel() { echo "T+$((${DUE[$1]} - T))ms"; }

section "enqueue(object, expiring_time): ZADD, or zdelay enqueue --at"
for obj in obj-a obj-c obj-b obj-d obj-e obj-f; do
    case $obj in
    obj-a | obj-b | obj-e)
        show "redis-cli ZADD scheduled_objects <$(rel $obj)> $obj" \
            rcli ZADD scheduled_objects "${DUE[$obj]}" "$obj"
        ;;
    *)
        show "zdelay enqueue --dest expired --id $obj --at <$(rel $obj)> --payload $obj" \
            zdelay enqueue --dest expired --id "$obj" --at "${DUE[$obj]}" --payload "$obj"
        ;;
    esac
done

section "remove(object) before it expires: ZREM, or zdelay cancel"
show "redis-cli ZREM scheduled_objects obj-b" rcli ZREM scheduled_objects obj-b
show "zdelay cancel obj-d" zdelay cancel obj-d
removed_at=$(redis_ms)
((removed_at < ${DUE[obj-b]})) || die "the removals ended at T+$((removed_at - T))ms, after obj-b was due: machine too slow for this timeline"

section "get_expired(): nothing to poll, the consumer blocks in BRPOP queue:expired"
wait_until 20 "the consumer's $EXPECTED pops" not_alive "$CONSUMER"
wait "$CONSUMER" || die "the consumer failed"
BG_PIDS=()
mapfile -t lines <"$WORK/consumed.txt"
got=0
for ((i = 0; i + 3 < ${#lines[@]}; i += 4)); do
    obj=${lines[i + 1]}
    arrived=$((lines[i + 2] * 1000 + 10#${lines[i + 3]} / 1000))
    [[ -n ${DUE[$obj]:-} ]] || die "unexpected payload $obj"
    late=$((arrived - ${DUE[$obj]}))
    ((late >= 0)) || die "$obj arrived ${late}ms early"
    say "${lines[i]} <- $obj"
    note "$obj due $(rel "$obj"), arrived ${late} ms after its due time"
    got=$((got + 1))
done
((got == EXPECTED)) || die "expected $EXPECTED arrivals, got $got: $(cat "$WORK/consumed.txt")"

section "removed objects never expire"
say "queue:expired holds $(rcli LLEN queue:expired), scheduled_objects holds $(rcli ZCARD scheduled_objects)"
show "zdelay get obj-d" zdelay get obj-d

section "remove(object) after it expired: nothing left to remove"
show "redis-cli ZREM scheduled_objects obj-a" rcli ZREM scheduled_objects obj-a
show "zdelay cancel obj-c" zdelay cancel obj-c

section "no polling worker: zdelay was woken by the writes themselves"
keyspace=$(metric 'zdelay_wakeups_total{cause="keyspace"}')
enqueue=$(metric 'zdelay_wakeups_total{cause="enqueue"}')
note "wake-ups: keyspace ${keyspace:-0}, enqueue ${enqueue:-0}"
say "woken by keyspace notifications: $([[ ${keyspace:-0} -gt 0 ]] && echo yes || echo no)"
say "woken by enqueues: $([[ ${enqueue:-0} -gt 0 ]] && echo yes || echo no)"

stop_daemon
say "zdelay stopped (SIGTERM, exit 0)"
say OK
