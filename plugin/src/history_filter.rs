//! What the history filters' words mean, for `history`'s flags and the
//! console's filter form alike.

use agentrun_api::RunPhase;
use jiff::Timestamp;
/// `Succeeded`, `Failed` or `Cancelled`: the outcomes a record can have.
pub fn outcome(word: &str) -> Result<RunPhase, String> {
    serde_json::from_value::<RunPhase>(serde_json::Value::String(word.to_owned()))
        .ok()
        .filter(|p| p.is_finished())
        .ok_or_else(|| "a record ends Succeeded, Failed or Cancelled".to_owned())
}

/// The start of a time filter: a duration back from `now` (`24h`, `30m`,
/// `168h`), a time (`2026-12-01T08:00:00Z`) or a day (`2026-12-01`, from
/// midnight UTC).
pub fn since(text: &str, now: Timestamp) -> Result<Timestamp, String> {
    let text = text.trim();
    if let Ok(d) = agentrun_api::Duration::from(text).parse() {
        return Ok(now.checked_sub(d).unwrap_or(Timestamp::MIN));
    }
    if let Ok(t) = text.parse::<Timestamp>() {
        return Ok(t);
    }
    if let Ok(day) = text.parse::<jiff::civil::Date>()
        && let Ok(z) = day.to_zoned(jiff::tz::TimeZone::UTC)
    {
        return Ok(z.timestamp());
    }
    Err(
        "a duration back from now (24h, 30m), a time (2026-12-01T08:00:00Z) or a day (2026-12-01)"
            .into(),
    )
}
