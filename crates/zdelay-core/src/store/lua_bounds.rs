//! No script runs an unbounded command: every `redis.call` of every file in `lua/` (includes
//! too) that reads, removes or combines a range or a whole key must say its bound in the
//! call (`LIMIT`, `COUNT`, or a rank range from one expression to itself), or be listed in
//! [`BOUNDED_ELSEWHERE`] with the reason its size is bounded. A new unbounded call fails here.

use std::path::Path;

/// Commands that work on a whole key or a whole range, bounded by nothing in the call.
const WHOLE: &[&str] = &[
    "KEYS",
    "HGETALL",
    "HKEYS",
    "HVALS",
    "SMEMBERS",
    "SINTER",
    "SUNION",
    "SDIFF",
    "SINTERSTORE",
    "SUNIONSTORE",
    "SDIFFSTORE",
    "ZUNIONSTORE",
    "ZINTERSTORE",
    "ZDIFFSTORE",
    "ZUNION",
    "ZINTER",
    "ZDIFF",
    "ZREMRANGEBYSCORE",
    "ZREMRANGEBYLEX",
    "SORT",
    "SORT_RO",
    "DEL",
    "LREM",
    "FLUSHALL",
    "FLUSHDB",
];
/// Score or lex ranges: bounded by a `LIMIT`.
const NEED_LIMIT: &[&str] = &[
    "ZRANGEBYSCORE",
    "ZREVRANGEBYSCORE",
    "ZRANGEBYLEX",
    "ZREVRANGEBYLEX",
];
/// Rank ranges (`ZRANGE` also takes `BYSCORE`/`BYLEX`, then it needs a `LIMIT`): bounded when
/// the range is one element (the same expression twice); any other range is listed.
const RANKS: &[&str] = &[
    "ZRANGE",
    "ZREVRANGE",
    "ZRANGESTORE",
    "ZREMRANGEBYRANK",
    "LRANGE",
    "LTRIM",
];
/// Cursor walks: bounded by a `COUNT`.
const SCANS: &[&str] = &["SCAN", "HSCAN", "SSCAN", "ZSCAN"];

/// (file, the call's arguments without whitespace, why it is bounded).
#[rustfmt::skip]
const BOUNDED_ELSEWHERE: &[(&str, &str, &str)] = &[
    ("bench_bare_move_hash.lua", "KEYS[1],0,#ids-1",
     "the ids the call just read with LIMIT ARGV[1]"),
    ("bench_bare_move_stream.lua", "KEYS[1],0,n-1",
     "the n ids the call just read with LIMIT ARGV[1]"),
    ("bench_bare_move_raw.lua", "KEYS[1],0,#items-1",
     "the items the call just read with LIMIT ARGV[1]"),
    ("bench_bare_move_raw_checked.lua", "KEYS[1],n,n+chunk-1",
     "chunk ≤ the batch left to read"),
    ("bench_bare_move_raw_checked.lua", "KEYS[1],0,n-1",
     "the n members the call just read, at most the batch"),
    ("claim_raw.lua", "src,count,count+chunk-1,'WITHSCORES'",
     "chunk ≤ the batch left to read"),
    ("claim_slots.lua", "instances_key",
     "one field per live daemon"),
    ("claim_slots.lua", "slots_key",
     "one field per poller slot: shards × per_shard and raw sources"),
    ("claim_slots.lua", "plan_key",
     "the plan: one field per live daemon, rewritten in the same call"),
    ("drop_ended_windows.lua", "KEYS[1],0,n-1",
     "n ≤ ARGV[1] (ENDED_WINDOWS_PER_CALL)"),
    ("relocate_drop_lane.lua", "key,0,999",
     "1000 entries"),
    ("move_due.lua", "due_key,0,n-1",
     "the n ≤ batch ids the call read with LIMIT"),
    ("move_due.lua", "claims_key",
     "nothing in flight: only records whose last job left without a settle or an expiry \
      (replaced in flight), one field each"),
    ("move_lane.lua", "due_key,n-1,n,'WITHSCORES'",
     "two elements"),
    ("move_lane.lua", "due_key,'0',n-1",
     "the n ≤ batch ids the call read with LIMIT"),
    ("move_lane.lua", "due_key,0,n-1",
     "the n ≤ batch ids the call read with LIMIT"),
    ("include/fire_schedules_body.lua", "direct.list,unpack(payloads)",
     "the push (LPUSH or RPUSH) of the call's due occurrences: at most MAX_OCCURRENCES"),
    ("move_lane.lua", "list_key,unpack(payload_list,from+shift,to+shift)",
     "the push (LPUSH or RPUSH, from the marker) of a chunk of the batch the call read"),
    ("move_raw.lua", "src,n,n+chunk-1",
     "chunk ≤ the batch left to read"),
    ("move_raw.lua", "src,0,moved-1",
     "moved ≤ the batch the call read"),
    ("move_raw.lua", "src,0,n-1",
     "the n ≤ batch members the call read"),
    ("move_raw.lua", "list,unpack(chunks[c])",
     "LPUSH/RPUSH of a chunk of the batch"),
    ("move_raw.lua", "list,unpack(payloads)",
     "LPUSH/RPUSH of the batch the call read"),
    ("release_slots.lua", "KEYS[2]",
     "one field per poller slot: shards × per_shard and raw sources"),
    ("release_slots.lua", "KEYS[4]",
     "the plan: one field per live daemon"),
    ("reshard_scan.lua", "KEYS[1],ARGV[2],'COUNT',ARGV[3]",
     "HSCAN or ZSCAN with a COUNT"),
    ("unlock.lua", "KEYS[1]",
     "a lock: one string"),
    ("include/enqueue_policy.lua", "windows_key,0,math.min(ended,500+#ARGV)-1",
     "at most 500 more than the call's arguments"),
];

/// A `redis.call`/`redis.pcall` in a script: its file, line, command (upper case; `None`
/// when not a literal) and its arguments after the command, comments removed.
#[derive(Debug)]
struct Call {
    file: String,
    line: usize,
    command: Option<String>,
    args: String,
}

/// The text with Lua comments (`--` to the end of the line, outside strings) blanked out.
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut quote = None;
        let mut cut = line.len();
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            match quote {
                Some(_) if c == b'\\' => i += 1,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if c == b'\'' || c == b'"' => quote = Some(c),
                None if c == b'-' && bytes.get(i + 1) == Some(&b'-') => {
                    cut = i;
                    break;
                }
                None => {}
            }
            i += 1;
        }
        out.push_str(&line[..cut]);
        out.push('\n');
    }
    out
}

fn calls(file: &str, text: &str) -> Vec<Call> {
    let code = without_comments(text);
    let mut out = Vec::new();
    for pattern in ["redis.call(", "redis.pcall("] {
        for (at, _) in code.match_indices(pattern) {
            let start = at + pattern.len();
            // The closing parenthesis, outside strings ('(' .. x is common in scores).
            let (mut depth, mut quote, mut escaped) = (1, None, false);
            let mut end = code.len();
            for (i, c) in code[start..].char_indices() {
                match (quote, c) {
                    (Some(_), _) if escaped => escaped = false,
                    (Some(_), '\\') => escaped = true,
                    (Some(q), c) if c == q => quote = None,
                    (Some(_), _) => {}
                    (None, '\'' | '"') => quote = Some(c),
                    (None, '(' | '{') => depth += 1,
                    (None, ')' | '}') => depth -= 1,
                    (None, _) => {}
                }
                if depth == 0 {
                    end = start + i;
                    break;
                }
            }
            let inner = &code[start..end];
            let (first, rest) = inner.split_once(',').unwrap_or((inner, ""));
            let first = first.trim();
            let command = (first.len() >= 2
                && (first.starts_with('\'') || first.starts_with('"'))
                && first.ends_with(&first[..1]))
            .then(|| first[1..first.len() - 1].to_uppercase());
            out.push(Call {
                file: file.to_owned(),
                line: code[..at].matches('\n').count() + 1,
                command,
                args: rest.split_whitespace().collect(),
            });
        }
    }
    out
}

/// Why a call is not bounded by what it says itself (`None`: it is).
fn unbounded(call: &Call) -> Option<&'static str> {
    let Some(command) = call.command.as_deref() else {
        return Some("a command that is not a literal");
    };
    let has = |word: &str| {
        call.args.to_uppercase().contains(&format!("'{word}'"))
            || call.args.to_uppercase().contains(&format!("\"{word}\""))
    };
    if WHOLE.contains(&command) {
        return Some("works on the whole key or range");
    }
    if NEED_LIMIT.contains(&command) && !has("LIMIT") {
        return Some("a score or lex range without LIMIT");
    }
    if RANKS.contains(&command) {
        if has("BYSCORE") || has("BYLEX") {
            return (!has("LIMIT")).then_some("a score or lex range without LIMIT");
        }
        // key, start, stop: bounded when start and stop are the same.
        let parts: Vec<&str> = call.args.splitn(4, ',').collect();
        let (start, stop) = (parts.get(1).copied(), parts.get(2).copied());
        let stop = stop.map(|s| s.split(',').next().unwrap_or(s));
        if start.is_none() || start != stop {
            return Some("a rank range of more than one element");
        }
    }
    if SCANS.contains(&command) && !has("COUNT") {
        return Some("a cursor walk without COUNT");
    }
    None
}

fn every_call() -> Vec<Call> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("lua");
    let mut out = Vec::new();
    for dir in [root.clone(), root.join("include")] {
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("lua/ reads")
            .map(|e| e.expect("an entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "lua"))
            .collect();
        files.sort();
        for path in files {
            let name = path
                .strip_prefix(&root)
                .expect("under lua/")
                .display()
                .to_string();
            let text = std::fs::read_to_string(&path).expect("a script reads");
            out.extend(calls(&name, &text));
        }
    }
    out
}

#[test]
fn no_script_runs_an_unbounded_command() {
    let calls = every_call();
    assert!(calls.len() > 300, "found only {} calls", calls.len());
    let mut flagged = Vec::new();
    let mut used = vec![false; BOUNDED_ELSEWHERE.len()];
    for call in &calls {
        let Some(why) = unbounded(call) else { continue };
        match BOUNDED_ELSEWHERE
            .iter()
            .position(|(file, args, _)| *file == call.file && *args == call.args)
        {
            Some(i) => used[i] = true,
            None => flagged.push(format!(
                "{}:{}: {} {}: {why}",
                call.file,
                call.line,
                call.command.as_deref().unwrap_or("?"),
                call.args
            )),
        }
    }
    assert!(
        flagged.is_empty(),
        "calls with no bound of their own: give each a LIMIT/COUNT or a bounded range, or (when \
         its size is bounded by something else) list it in BOUNDED_ELSEWHERE with the reason:\n{}",
        flagged.join("\n")
    );
    let stale: Vec<_> = BOUNDED_ELSEWHERE
        .iter()
        .zip(used)
        .filter(|(_, used)| !used)
        .map(|((file, args, _), _)| format!("{file}: {args}"))
        .collect();
    assert!(
        stale.is_empty(),
        "listed but no longer in a script: {stale:?}"
    );
}

#[test]
fn the_lint_finds_what_it_must() {
    let found = |lua: &str| {
        let calls = calls("t.lua", lua);
        assert_eq!(calls.len(), 1, "{lua}");
        unbounded(&calls[0])
    };
    assert!(found("redis.call('ZREMRANGEBYSCORE', k, '-inf', now)").is_some());
    assert!(found("redis.call('zrangebyscore', k, '-inf', now)").is_some());
    assert!(found("redis.call('ZRANGEBYSCORE', k, '-inf', now, 'LIMIT', 0, n)").is_none());
    assert!(found("redis.call('ZRANGE', k, '-inf', now, 'BYSCORE')").is_some());
    assert!(found("redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')").is_none());
    assert!(found("redis.call('ZRANGE', k, 0, -1)").is_some());
    assert!(found("redis.call('LRANGE', k,\n  0, n - 1)").is_some());
    assert!(found("redis.call(cmd, k)").is_some());
    assert!(found("redis.call('HGETALL', k) -- redis.call('GET', k)").is_some());
    assert!(found("redis.call('GET', 'a -- b')").is_none());
    assert!(found("redis.pcall('SMEMBERS', k)").is_some());
    assert!(found("redis.call('HSCAN', k, c, 'COUNT', 10)").is_none());
    assert!(found("redis.call('ZRANGEBYLEX', k, '(' .. a, '+', 'LIMIT', 0, 1)").is_none());
    assert!(found("redis.call('ZRANGEBYLEX', k, '(' .. a, '+')").is_some());
}
