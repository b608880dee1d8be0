//! Test-only fault injection (feature `test-failpoints`), from `ZDELAY_FAILPOINT`: the one
//! way every hold point stalls. Without the feature each call is a no-op.

/// With `ZDELAY_FAILPOINT=<name>=PATH`: creates `PATH.reached`, then waits until PATH exists,
/// so a test can act in the window the hold point opens. Any other value: returns at once.
#[cfg(feature = "test-failpoints")]
pub async fn hold(name: &str) {
    let Ok(spec) = std::env::var("ZDELAY_FAILPOINT") else {
        return;
    };
    let Some(path) = spec
        .strip_prefix(name)
        .and_then(|rest| rest.strip_prefix('='))
    else {
        return;
    };
    eprintln!("failpoint {name}: waiting for {path}");
    let _ = std::fs::write(format!("{path}.reached"), b"");
    while !std::path::Path::new(path).exists() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[cfg(not(feature = "test-failpoints"))]
pub async fn hold(_name: &str) {}

/// With `ZDELAY_FAILPOINT=<name>=VALUE`: VALUE, for a test that makes the build claim
/// something else. Otherwise (and without the feature) `None`.
#[cfg(feature = "test-failpoints")]
pub fn value(name: &str) -> Option<String> {
    let spec = std::env::var("ZDELAY_FAILPOINT").ok()?;
    spec.strip_prefix(name)?
        .strip_prefix('=')
        .map(str::to_owned)
}

#[cfg(not(feature = "test-failpoints"))]
pub fn value(_name: &str) -> Option<String> {
    None
}
