//! The producer protocol's Redis Functions library (`docs/reference/protocol.md`): the
//! producer scripts of `lua/`, each under a stable function name, so that a client in any
//! language calls `FCALL` and carries no Lua of its own. Each function is its script's body,
//! unchanged: the keys and arguments its header documents are the function's, so the library
//! and the scripts the Rust client runs cannot drift apart.
//!
//! Functions rather than scripts: a library is stored with the data (RDB/AOF) and replicated,
//! so it survives restarts and failovers where the script cache does not; it is named and
//! versioned (`FUNCTION LIST`); an ACL may grant `+fcall` alone. Redis 7.0 and Valkey 7.2 have
//! them. Every daemon loads the library at start (`FUNCTION LOAD REPLACE`, on every master of
//! a cluster); a newer protocol version is a new library beside this one, so producers of both
//! keep working during a rolling upgrade.

use super::Conn;

/// The producer protocol version this build speaks: the `zd<N>_` of the function names.
pub const PROTOCOL: u32 = 1;

/// The library's name (`FUNCTION LIST LIBRARYNAME zdelay_p1`).
pub const LIBRARY: &str = "zdelay_p1";

/// (function name, the script of `lua/` it runs, whether it only reads).
pub const FUNCTIONS: &[(&str, &str, bool)] = &[
    ("zd1_enqueue", "enqueue_jobs", false),
    ("zd1_cancel", "cancel_job", false),
    ("zd1_reschedule", "reschedule_job", false),
    ("zd1_get", "get_job", true),
    ("zd1_enqueue_lane", "enqueue_lane", false),
    ("zd1_cancel_lane", "cancel_lane", false),
    ("zd1_reschedule_lane", "reschedule_lane", false),
    ("zd1_get_lane", "get_lane", true),
    ("zd1_schedule", "schedule_request", false),
];

/// The script a function of the library runs.
pub fn script_of(function: &str) -> Option<&'static str> {
    FUNCTIONS
        .iter()
        .find(|(name, _, _)| *name == function)
        .map(|(_, script, _)| *script)
}

fn source_of(script: &str) -> &'static str {
    super::scripts::ALL
        .iter()
        .find(|(name, _)| *name == script)
        .map(|(_, source)| *source)
        .expect("every function runs a script of lua/")
}

/// The library's source, built once: the daemons send it at start and at every stats sample.
pub fn library() -> &'static str {
    static LIBRARY_SOURCE: std::sync::LazyLock<String> = std::sync::LazyLock::new(build_library);
    &LIBRARY_SOURCE
}

/// Every function's script body inside `function(KEYS, ARGV)`, then `zd1_protocol`, which
/// answers the protocol version and the build that loaded it.
fn build_library() -> String {
    let mut lua = format!("#!lua name={LIBRARY}\n");
    for (i, (name, script, read_only)) in FUNCTIONS.iter().enumerate() {
        let body = source_of(script);
        lua.push_str(&format!("local function f{i}(KEYS, ARGV)\n{body}\nend\n"));
        let flags = if *read_only { "{'no-writes'}" } else { "{}" };
        lua.push_str(&format!(
            "redis.register_function{{function_name='{name}', callback=f{i}, flags={flags}}}\n"
        ));
    }
    lua.push_str(&format!(
        "redis.register_function{{function_name='zd{PROTOCOL}_protocol', \
         callback=function() return {{ {PROTOCOL}, '{}' }} end, flags={{'no-writes'}}}}\n",
        env!("CARGO_PKG_VERSION")
    ));
    lua
}

/// Loads (or replaces) the library on the server, on every master of a cluster.
pub async fn load(con: &mut Conn) -> redis::RedisResult<()> {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg("REPLACE").arg(library());
    con.on_every_primary(cmd).await.map(drop)
}

/// Loads the library where it is missing — a server restarted without persistence, a master
/// added to the cluster — and leaves it where it is: `FUNCTION LOAD` without `REPLACE`, which a
/// server holding the library refuses before compiling anything (about 5 µs).
pub async fn ensure(con: &mut Conn) -> redis::RedisResult<()> {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg(library());
    match con.on_every_primary(cmd).await {
        Err(e) if !e.to_string().contains("already exists") => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_is_a_script_body_under_a_protocol_name() {
        let lua = library();
        assert!(lua.starts_with("#!lua name=zdelay_p1\n"));
        for (name, script, _) in FUNCTIONS {
            assert!(name.starts_with(&format!("zd{PROTOCOL}_")), "{name}");
            let body = source_of(script);
            assert!(body.starts_with(&format!("-- {script}: ")), "{script}");
            assert!(
                lua.contains(body),
                "{name}'s script is in the library as it is"
            );
            assert!(lua.contains(&format!("function_name='{name}'")));
        }
        assert!(lua.contains(&format!("function_name='zd{PROTOCOL}_protocol'")));
        assert_eq!(
            lua.matches("redis.register_function{").count(),
            FUNCTIONS.len() + 1
        );
    }
}
