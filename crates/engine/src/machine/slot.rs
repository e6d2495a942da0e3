//! The words of an attempt the machine's stages share: where its record lives
//! in status ([`Slot`]), what it did to the outside world as far as anyone
//! knows ([`Acted`]), and what is about to start ([`Start`]).

use crate::names::PodRole;

/// Where an attempt's record lives in status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    /// `status.steps[i]`: a step, the planner or a compactor.
    Step(usize),
    /// `status.compensations[k]`.
    Compensation(usize),
}

/// What a failed attempt did to the outside world, as far as anyone knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Acted {
    /// Nothing: it said `"effect": "NotApplied"`, never started, or is not
    /// a step with an effect.
    No,
    /// It may have: it ended without saying it did not act (D6).
    Maybe,
    /// It did: it reported its effect and then failed in another way (a
    /// result its `resultSchema` refuses).
    Yes,
}

/// What is about to start.
#[derive(Clone, Copy, Debug)]
pub(super) enum Start<'s> {
    /// A new attempt of `role` at `name`, revision `rev`, with key `key`.
    New {
        role: PodRole,
        name: &'s str,
        rev: i64,
        key: &'s str,
    },
    /// The Pod of the attempt recorded in this slot, never seen.
    Again(Slot),
}
