//! The reconciler's errors, one variant per pipeline stage, classified so the
//! error policy knows whether to back off or wait for a change.

use std::time::Duration;

/// A failure of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The run's status changed under us (409 on the guarded status write)
    /// more times in a row than one reconcile retries.
    #[error("status of {run} kept changing under the operator ({attempts} conflicts)")]
    StatusConflict { run: String, attempts: u32 },

    /// Re-reading the run after a conflict failed.
    #[error("re-reading {run}: {source}")]
    Reread {
        run: String,
        #[source]
        source: kube::Error,
    },

    /// The guarded status write failed for another reason.
    #[error("writing status of {run}: {source}")]
    WriteStatus {
        run: String,
        #[source]
        source: kube::Error,
    },

    /// Applying one of the engine's actions failed; the next reconcile re-derives it.
    #[error("{action} for {run}: {source}")]
    Apply {
        run: String,
        action: String,
        #[source]
        source: kube::Error,
    },

    /// The API server refused to create an object the run needs (or a
    /// foreign object holds its name); the run shows it (`Stalled`) and the
    /// creation is tried again with backoff.
    #[error("{run}: the API server refused to create {names}")]
    CreateRefused { run: String, names: String },

    /// Reading a step Pod the run records and the cache does not show failed.
    #[error("reading Pod {pod} of {run}: {source}")]
    ReadPod {
        run: String,
        pod: String,
        #[source]
        source: kube::Error,
    },

    /// The object has no name or namespace (never true for a stored object).
    #[error("object is missing {0}")]
    MissingMetadata(&'static str),

    /// The reconcile did not finish in time (an API request that is never
    /// answered): it was abandoned, as a crash would have left it, and
    /// tried again with backoff.
    #[error("reconcile of {run} did not finish within {after:?}; abandoned and tried again")]
    Timeout { run: String, after: Duration },

    /// The decision itself did not complete (it panicked on the blocking
    /// pool): nothing of it is applied, and the run is tried again.
    #[error("deciding {run}: {message}")]
    Decide { run: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How the error policy treats a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    /// The API server refused or failed transiently: back off and retry.
    Transient,
    /// Contention on the run's status: retry soon.
    Conflict,
    /// Retrying cannot help until something changes (a foreign object).
    Permanent,
}

impl Error {
    pub fn category(&self) -> Category {
        match self {
            Error::StatusConflict { .. } => Category::Conflict,
            Error::MissingMetadata(_) => Category::Permanent,
            Error::Reread { .. }
            | Error::ReadPod { .. }
            | Error::WriteStatus { .. }
            | Error::Apply { .. }
            | Error::CreateRefused { .. }
            | Error::Timeout { .. }
            | Error::Decide { .. } => Category::Transient,
        }
    }

    /// A short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::StatusConflict { .. } => "conflict",
            Error::Reread { .. } => "reread",
            Error::ReadPod { .. } => "read_pod",
            Error::WriteStatus { .. } => "write_status",
            Error::Apply { .. } => "apply",
            Error::CreateRefused { .. } => "create_refused",
            Error::MissingMetadata(_) => "missing_metadata",
            Error::Timeout { .. } => "timeout",
            Error::Decide { .. } => "decide",
        }
    }
}

/// Per-object exponential backoff: 250 ms doubling per consecutive failure,
/// capped at 5 minutes (a permanent error waits the cap, then looks again).
pub fn backoff(category: Category, consecutive_failures: u32) -> Duration {
    const BASE_MS: u64 = 250;
    const CAP: Duration = Duration::from_secs(300);
    match category {
        Category::Permanent => CAP,
        Category::Conflict | Category::Transient => {
            let exp = consecutive_failures.saturating_sub(1).min(16);
            Duration::from_millis(BASE_MS.saturating_mul(1 << exp)).min(CAP)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_per_failure_and_is_capped() {
        let cases = [
            ("first transient failure", Category::Transient, 1, 250),
            ("second", Category::Transient, 2, 500),
            ("fifth", Category::Transient, 5, 4_000),
            ("many", Category::Transient, 40, 300_000),
            ("conflict", Category::Conflict, 1, 250),
            ("permanent waits the cap", Category::Permanent, 1, 300_000),
        ];
        for (name, category, n, millis) in cases {
            assert_eq!(backoff(category, n).as_millis(), millis, "{name}");
        }
    }
}
