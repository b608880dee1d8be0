//! Named calendars in Redis (`{ns}:calendars`, name → JSON), so every daemon, CLI and the
//! console read the same days: set (create or replace), get, list, delete. A schedule that
//! names a calendar takes a copy of its days when it is set (`Client::schedule_set` refuses a
//! calendar that does not exist); changing a calendar applies to a schedule when it is set
//! again.

use crate::calendar::{Calendar, Shift, valid_calendar_name};
use crate::client::{Client, ClientError};
use crate::schedule::ScheduleCalendar;
use crate::store;
use serde::{Deserialize, Serialize};

/// A schedule's choice of calendar, as a user gives it (`--calendar NAME --shift …`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalendarChoice {
    pub name: String,
    pub shift: Shift,
}

/// A calendar as stored and listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredCalendar {
    pub name: String,
    pub days: Calendar,
    /// When it was last set (Redis clock, ms).
    pub updated_ms: i64,
}

impl Client {
    /// Creates or replaces calendar `name`. Returns whether it was created.
    pub async fn calendar_set(&self, name: &str, days: Calendar) -> Result<bool, ClientError> {
        valid_calendar_name(name).map_err(|e| ClientError::InvalidSchedule(e.to_string()))?;
        let mut con = self.con.clone();
        let updated_ms = store::server_time_ms(&mut con).await?;
        let stored = StoredCalendar {
            name: name.to_owned(),
            days,
            updated_ms,
        };
        let json = serde_json::to_string(&stored).expect("a calendar serializes");
        let created: i64 = redis::cmd("HSET")
            .arg(self.keys().calendars())
            .arg(name)
            .arg(json)
            .query_async(&mut con)
            .await?;
        Ok(created == 1)
    }

    /// Calendar `name`, or `None`.
    pub async fn calendar_get(&self, name: &str) -> Result<Option<StoredCalendar>, ClientError> {
        let text: Option<String> = redis::cmd("HGET")
            .arg(self.keys().calendars())
            .arg(name)
            .query_async(&mut self.con.clone())
            .await?;
        text.map(|t| parse(name, &t)).transpose()
    }

    /// Every calendar, by name.
    pub async fn calendar_list(&self) -> Result<Vec<StoredCalendar>, ClientError> {
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.keys().calendars())
            .query_async(&mut self.con.clone())
            .await?;
        let mut out = all
            .iter()
            .map(|(name, text)| parse(name, text))
            .collect::<Result<Vec<_>, _>>()?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes calendar `name`; `false` if there was none. Schedules that use it keep their
    /// copy of its days.
    pub async fn calendar_delete(&self, name: &str) -> Result<bool, ClientError> {
        let removed: i64 = redis::cmd("HDEL")
            .arg(self.keys().calendars())
            .arg(name)
            .query_async(&mut self.con.clone())
            .await?;
        Ok(removed == 1)
    }

    /// What a schedule set with `choice` carries: the calendar's days now. A calendar that
    /// does not exist is refused, naming it.
    pub(crate) async fn schedule_calendar(
        &self,
        choice: Option<&CalendarChoice>,
    ) -> Result<Option<ScheduleCalendar>, ClientError> {
        let Some(choice) = choice else {
            return Ok(None);
        };
        let stored = self.calendar_get(&choice.name).await?.ok_or_else(|| {
            ClientError::InvalidSchedule(format!(
                "invalid schedule: calendar: no calendar named {:?} (create it with `zdelay calendar set`)",
                choice.name
            ))
        })?;
        Ok(Some(ScheduleCalendar {
            name: choice.name.clone(),
            shift: choice.shift,
            days: stored.days,
        }))
    }
}

fn parse(name: &str, text: &str) -> Result<StoredCalendar, ClientError> {
    serde_json::from_str(text)
        .map_err(|e| ClientError::InvalidSchedule(format!("calendar {name:?} cannot be read: {e}")))
}
