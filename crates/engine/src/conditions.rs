//! Standard `metav1.Condition` bookkeeping: `lastTransitionTime` moves only
//! when a condition's status changes, so an unchanged world gives an unchanged
//! status and the operator does not wake itself up.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::reasons::ConditionType;

pub const TRUE: &str = "True";
pub const FALSE: &str = "False";
pub const UNKNOWN: &str = "Unknown";

/// Sets condition `type_`, keeping its transition time when the status is unchanged.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: ConditionType,
    status: &str,
    reason: impl AsRef<str>,
    message: impl Into<String>,
    generation: Option<i64>,
    now: Timestamp,
) {
    let (type_, reason) = (type_.as_str(), reason.as_ref());
    let message = message.into();
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.status = status.to_owned();
                c.last_transition_time = Time(now);
            }
            c.reason = reason.to_owned();
            c.message = message;
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
}

pub fn get(conditions: &[Condition], type_: ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == type_.as_str())
}

pub fn is_true(conditions: &[Condition], type_: ConditionType) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == TRUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_with_status() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let mut cs = Vec::new();
        let p = ConditionType::Progressing;
        set(&mut cs, p, TRUE, "Running", "a", Some(1), t0);
        set(&mut cs, p, TRUE, "Running", "b", Some(2), t1);
        assert_eq!(
            cs[0].last_transition_time,
            Time(t0),
            "same status keeps the time"
        );
        assert_eq!(
            (cs[0].message.as_str(), cs[0].observed_generation),
            ("b", Some(2))
        );
        set(&mut cs, p, FALSE, "Suspended", "", Some(2), t1);
        assert_eq!(cs[0].last_transition_time, Time(t1));
        assert_eq!(cs.len(), 1);
    }
}
