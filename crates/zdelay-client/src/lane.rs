//! Route lanes (storage layout 2, being built): one local route's jobs kept in the hash slot
//! of the route's list, so the move that pushes them and removes them is one script on one
//! Redis and on a cluster alike, and knows the route from its keys instead of parsing each
//! job. See docs/internals/layout-2.md.

use crate::config::Push;
use crate::keys::LaneKeys;

/// One route lane as registered: its number, the route it holds, and where it delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lane {
    /// Given out once per lane by the registry, never reused.
    pub number: u32,
    pub route: String,
    /// The list the lane's jobs are pushed onto.
    pub list: String,
    pub push: Push,
    pub keys: LaneKeys,
}

impl Lane {
    /// A lane of `route` in namespace `namespace`, its keys tagged with `tag` (the tag of the
    /// list's slot).
    pub fn new(
        namespace: &str,
        tag: &str,
        number: u32,
        route: &str,
        list: &str,
        push: Push,
    ) -> Lane {
        Lane {
            number,
            route: route.to_owned(),
            list: list.to_owned(),
            push,
            keys: LaneKeys::new(namespace, tag, route),
        }
    }

    /// The marker a live lane holds: `2 <lane> <LPUSH|RPUSH> <list key>`. Every lane script
    /// refuses a call whose expected marker differs, so a lane is delivered only as registered.
    pub fn marker(&self) -> String {
        format!(
            "2 {} {} {}",
            base36(self.number),
            self.push.command(),
            self.list
        )
    }

    /// The lane's name in wake messages: `l<lane>`.
    pub fn wake_name(&self) -> String {
        format!("l{}", base36(self.number))
    }
}

/// Lane numbers as written in markers, wake messages and generated ids: base 36, `0`–`9`
/// then `a`–`z`.
pub fn base36(mut n: u32) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).expect("ASCII digits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_numbers_are_base36() {
        assert_eq!(base36(0), "0");
        assert_eq!(base36(35), "z");
        assert_eq!(base36(36), "10");
        assert_eq!(base36(36 * 36 + 1), "101");
        assert_eq!(base36(u32::MAX), "1z141z3");
    }

    #[test]
    fn marker_names_the_lane_push_and_list() {
        let lane = Lane::new("zdelay", "emj", 56, "emails", "emails-delayed", Push::Rpush);
        assert_eq!(lane.marker(), "2 1k RPUSH emails-delayed");
        assert_eq!(lane.wake_name(), "l1k");
        assert_eq!(lane.keys.due, "zdelay:{emj}:due:emails");
        assert_eq!(lane.keys.marker, "zdelay:{emj}:lane:emails");
    }
}
