//! The producer protocol's Redis Functions library (`docs/reference/protocol.md`): the
//! producer scripts of `lua/`, each under a stable function name, so that a client in any
//! language calls `FCALL` and carries no Lua of its own. Each function is its script's body,
//! unchanged: the keys and arguments its header documents are the function's, so the library
//! and the scripts the Rust client runs cannot drift apart.
//!
//! Functions rather than scripts: a library is stored with the data (RDB/AOF) and replicated,
//! so it survives restarts and failovers where the script cache does not; it is named and
//! versioned (`FUNCTION LIST`); an ACL may grant `+fcall` alone. Redis 7.0 and Valkey 7.2 have
//! them.
//!
//! Versions. A library has a protocol version (its name, `zdelay_p<N>`, and its functions'
//! `zd<N>_`) and, within it, a revision ([`REVISION`]) and a body (the SHA-1 of its functions'
//! text), which `zd<N>_protocol` answers. A revision only fixes or bounds what the protocol
//! already promises; anything a client could come to rely on is a new protocol version, a new
//! library loaded beside this one. A daemon ([`sync`], at start and at every stats sample, on
//! every master) loads the library where it is missing, replaces an older revision, and leaves
//! a newer one, or another body of its own revision, as it is: the last daemon to start never
//! puts an older body back. It reads and loads only its own version's library: another
//! version's (`zdelay_p1`, which older producers call until they are upgraded) stays as it is.

use super::Conn;
use redis::Value;

/// The producer protocol version this build speaks: the `zd<N>_` of the function names.
pub const PROTOCOL: u32 = 2;

/// The library's name (`FUNCTION LIST LIBRARYNAME zdelay_p2`). Another protocol version's
/// library (`zdelay_p1`, which older producers call) has another name and other function names,
/// so it stays loaded beside this one: [`sync`] never reads, replaces or removes it.
pub const LIBRARY: &str = "zdelay_p2";

/// (function name, the script of `lua/` it runs, whether it only reads).
pub const FUNCTIONS: &[(&str, &str, bool)] = &[
    ("zd2_enqueue", "enqueue_jobs", false),
    ("zd2_cancel", "cancel_job", false),
    ("zd2_reschedule", "reschedule_job", false),
    ("zd2_get", "get_job", true),
    ("zd2_enqueue_lane", "enqueue_lane", false),
    ("zd2_cancel_lane", "cancel_lane", false),
    ("zd2_reschedule_lane", "reschedule_lane", false),
    ("zd2_get_lane", "get_lane", true),
    ("zd2_schedule", "schedule_request", false),
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

/// The library's revision within protocol [`PROTOCOL`]. Bump it with any change to a function's
/// text (a script of `FUNCTIONS`, an include they use, or how the library is put together) and
/// set `BODY_SHA1` (below) to the new body's hash: a unit test fails until both agree, so a changed
/// body cannot ship under an old revision. A new protocol version starts again at revision 1.
pub const REVISION: u32 = 2;

/// The SHA-1 of the body of [`REVISION`] (the library's text before `zd<N>_protocol`).
#[cfg(test)]
const BODY_SHA1: &str = "0f6d6256ad16531f9ed13acf774af555fdc6ba41";

/// What identifies a loaded library within its protocol version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub revision: u32,
    /// SHA-1 (hex) of the functions' text.
    pub body: String,
    /// The version of the zdelay build that loaded it.
    pub build: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "revision {} (zdelay {}", self.revision, self.build)?;
        match self.body.get(..12) {
            Some(short) => write!(f, ", body {short})"),
            None => write!(f, ")"),
        }
    }
}

/// The library this build loads: its source and identity, built once.
struct Built {
    source: String,
    identity: Identity,
}

fn built() -> &'static Built {
    static BUILT: std::sync::LazyLock<Built> = std::sync::LazyLock::new(build_library);
    &BUILT
}

/// The library's source: the daemons send it where it is missing or older.
pub fn library() -> &'static str {
    &built().source
}

/// This build's revision, body and version.
pub fn identity() -> &'static Identity {
    &built().identity
}

/// Every function's script body inside `function(KEYS, ARGV)`, then `zd<N>_protocol`, which
/// answers the protocol version, the build that loaded it, the revision and the body's hash.
fn build_library() -> Built {
    let mut lua = format!("#!lua name={LIBRARY}\n");
    for (i, (name, script, read_only)) in FUNCTIONS.iter().enumerate() {
        let body = source_of(script);
        lua.push_str(&format!("local function f{i}(KEYS, ARGV)\n{body}\nend\n"));
        let flags = if *read_only { "{'no-writes'}" } else { "{}" };
        lua.push_str(&format!(
            "redis.register_function{{function_name='{name}', callback=f{i}, flags={flags}}}\n"
        ));
    }
    let mut revision = REVISION;
    // Tests start this build claiming another revision, or another body under its own, to
    // play a daemon of another release (`library_claims=<revision>[:<mark>]`).
    if let Some(claim) = crate::failpoint::value("library_claims") {
        let (claimed, mark) = claim.split_once(':').unwrap_or((&claim, ""));
        revision = claimed.parse().unwrap_or(REVISION);
        if !mark.is_empty() {
            lua.push_str(&format!("-- {mark}\n"));
        }
    }
    let body = sha1_smol::Sha1::from(&lua).digest().to_string();
    let build = env!("CARGO_PKG_VERSION");
    lua.push_str(&format!(
        "redis.register_function{{function_name='zd{PROTOCOL}_protocol', \
         callback=function() return {{ {PROTOCOL}, '{build}', {revision}, '{body}' }} end, \
         flags={{'no-writes'}}}}\n"
    ));
    Built {
        source: lua,
        identity: Identity {
            revision,
            body,
            build: build.to_owned(),
        },
    }
}

/// What a master holds, read from its `zd<N>_protocol` (`None`: no library).
fn held(reply: redis::RedisResult<Value>) -> redis::RedisResult<Option<Identity>> {
    let values = match reply {
        Ok(Value::Array(values)) => values,
        Ok(other) => {
            return Err(unexpected(format!(
                "zd{PROTOCOL}_protocol answered {other:?}"
            )));
        }
        Err(e) if e.to_string().contains("Function not found") => return Ok(None),
        Err(e) => return Err(e),
    };
    let text =
        |i: usize| -> Option<String> { redis::from_redis_value(values.get(i)?.clone()).ok() };
    // Every revision of this protocol version answers { protocol, build, revision, body }.
    let revision = values
        .get(2)
        .and_then(|v| redis::from_redis_value(v.clone()).ok())
        .ok_or_else(|| {
            unexpected(format!(
                "zd{PROTOCOL}_protocol answered {values:?}, without a revision"
            ))
        })?;
    Ok(Some(Identity {
        revision,
        body: text(3).unwrap_or_default(),
        build: text(1).unwrap_or_default(),
    }))
}

fn unexpected(what: String) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Client, "producer function library", what))
}

/// What [`sync`] found on one master, and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This build's revision and body: nothing to do.
    Current,
    /// There was none: loaded.
    Loaded,
    /// An older revision (an older daemon started since): replaced with this one.
    Replaced(Identity),
    /// A newer revision: left as it is (it serves this build's producers too).
    Newer(Identity),
    /// This revision with another body, which one of the two builds got wrong: left as it is.
    OtherBody(Identity),
}

/// A master's address (`host:port`; empty on one Redis) and what [`sync`] did there.
pub type NodeOutcome = (String, Outcome);

/// Brings the library on every master to this build's revision unless a newer one or another
/// body of it is there: loads it where missing, replaces an older revision, and leaves the
/// rest. One read (`FCALL_RO zd<N>_protocol`) per master when nothing is to be done.
///
/// Between the read and a load another daemon may load too: two loads of a missing library
/// leave one (the second is refused), and a replace racing a newer daemon's may leave the
/// older revision until the newer daemon's next sample puts its own back.
pub async fn sync(con: &mut Conn) -> redis::RedisResult<Vec<NodeOutcome>> {
    let mut read = redis::cmd("FCALL_RO");
    read.arg(format!("zd{PROTOCOL}_protocol")).arg(0);
    let mine = identity();
    let mut outcomes = Vec::new();
    for (node, reply) in con.on_each_primary(read).await? {
        let outcome = match held(reply)? {
            None => {
                let mut load = redis::cmd("FUNCTION");
                load.arg("LOAD").arg(library());
                match con.on_primary(&node, load).await {
                    // Another daemon loaded it since the read: the next sample looks again.
                    Err(e) if e.to_string().contains("already exists") => Outcome::Current,
                    Err(e) => return Err(e),
                    Ok(_) => Outcome::Loaded,
                }
            }
            Some(found) if found.revision < mine.revision => {
                let mut load = redis::cmd("FUNCTION");
                load.arg("LOAD").arg("REPLACE").arg(library());
                con.on_primary(&node, load).await?;
                Outcome::Replaced(found)
            }
            Some(found) if found.revision > mine.revision => Outcome::Newer(found),
            Some(found) if found.body != mine.body => Outcome::OtherBody(found),
            Some(_) => Outcome::Current,
        };
        outcomes.push((node, outcome));
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_is_a_script_body_under_a_protocol_name() {
        let lua = library();
        assert!(lua.starts_with("#!lua name=zdelay_p2\n"));
        assert_eq!(LIBRARY, format!("zdelay_p{PROTOCOL}"));
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

    #[test]
    fn a_changed_body_is_a_new_revision() {
        let mine = identity();
        assert_eq!(mine.revision, REVISION);
        assert_eq!(
            mine.body, BODY_SHA1,
            "the producer function library's body changed: bump REVISION (now {REVISION}) in \
             crates/zdelay-core/src/store/functions.rs and set BODY_SHA1 to {}; a change a \
             client could rely on is a new protocol version instead (docs/reference/protocol.md)",
            mine.body
        );
        let protocol = library().rsplit_once("redis.register_function").unwrap().1;
        assert!(
            protocol.contains(&format!(
                "{{ {PROTOCOL}, '{}', {REVISION}, '{BODY_SHA1}' }}",
                mine.build
            )),
            "{protocol}"
        );
    }

    #[test]
    fn what_zd_protocol_answers_names_the_revision_and_body() {
        let answer = |values: Vec<Value>| held(Ok(Value::Array(values)));
        let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(
            answer(vec![
                Value::Int(2),
                text("0.2.0"),
                Value::Int(7),
                text("ab")
            ])
            .unwrap(),
            Some(Identity {
                revision: 7,
                body: "ab".into(),
                build: "0.2.0".into()
            })
        );
        assert!(answer(vec![Value::Int(2), text("0.2.0"), text("seven")]).is_err());
        // Only protocol 1's first revision answered two values; a library of this version
        // that does is not one a zdelay build loaded.
        assert!(answer(vec![Value::Int(2), text("0.2.0")]).is_err());
        let missing = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "Function not found",
        ));
        assert_eq!(held(Err(missing)).unwrap(), None);
    }
}
