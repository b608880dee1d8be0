//! The local Redis list sink: routes whose sink is the scheduling Redis itself.
//!
//! Its delivery is the `move_due` / `move_raw` script: the list keys are declared in KEYS
//! (which is why list destinations must be configured routes) and pushed to in the same
//! script that removes the jobs. This module turns the configured routes into that
//! script's KEYS and ARGV.

use crate::config::{Config, SinkConfig};
use redis::ScriptInvocation;

/// One local route as the move script sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalRoute {
    pub name: String,
    /// The list key due jobs are pushed to (the priority lane when configured).
    pub list: String,
    pub command: &'static str,
}

/// The table of local routes passed to `move_due`: list keys deduplicated into KEYS[5..].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LocalRoutes {
    pub routes: Vec<LocalRoute>,
    lists: Vec<String>,
}

/// KEYS taken by `move_due` before the list keys.
const FIXED_KEYS: usize = 6;

impl LocalRoutes {
    /// The routes of `config` whose sink is a Redis sink on the scheduling Redis.
    pub fn from_config(config: &Config) -> Self {
        let mut table = LocalRoutes::default();
        for route in &config.routes {
            let local = config
                .sinks
                .get(&route.sink)
                .is_some_and(SinkConfig::is_local);
            if local {
                table.add(LocalRoute {
                    name: route.name.clone(),
                    list: route.list_key(),
                    command: route.push.command(),
                });
            }
        }
        table
    }

    pub fn add(&mut self, route: LocalRoute) {
        if !self.lists.contains(&route.list) {
            self.lists.push(route.list.clone());
        }
        self.routes.push(route);
    }

    pub fn find(&self, name: &str) -> Option<&LocalRoute> {
        self.routes.iter().find(|r| r.name == name)
    }

    /// Adds the list KEYS (after the six shard keys) and the route ARGV triples.
    pub fn apply(&self, inv: &mut ScriptInvocation<'_>) {
        for list in &self.lists {
            inv.key(list);
        }
        inv.arg(self.routes.len());
        for route in &self.routes {
            let index = self
                .lists
                .iter()
                .position(|l| *l == route.list)
                .expect("every route's list was added");
            inv.arg(&route.name)
                .arg(FIXED_KEYS + index + 1)
                .arg(route.command);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_toml;

    #[test]
    fn routes_share_deduplicated_list_keys() {
        let c = from_toml(
            r#"
            [[routes]]
            name = "a"
            sink = "local"
            target = "q"
            [[routes]]
            name = "b"
            sink = "local"
            target = "q"
            push = "rpush"
            [[routes]]
            name = "c"
            sink = "local"
            target = "q"
            delayed_suffix = "-delayed"
            "#,
        )
        .unwrap();
        let t = LocalRoutes::from_config(&c);
        assert_eq!(t.lists, vec!["q", "q-delayed"]);
        assert_eq!(t.find("b").unwrap().command, "RPUSH");
        assert_eq!(t.find("c").unwrap().list, "q-delayed");
        assert!(t.find("d").is_none());
    }
}
