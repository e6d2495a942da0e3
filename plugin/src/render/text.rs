//! The pieces every rendering is made of: colours, ages and durations,
//! aligned tables, cut text and a step's mark.

use agentrun_api::StepPhase;
use jiff::{SignedDuration, Timestamp};

/// Colours for a terminal; none when not a TTY or with `NO_COLOR`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Style {
    pub color: bool,
}

impl Style {
    fn paint(&self, code: &str, s: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_owned()
        }
    }
    pub(super) fn phase(&self, phase: &str) -> String {
        let code = match phase {
            "Succeeded" => "32",
            "Failed" | "Cancelled" => "31",
            "WaitingForApproval" | "Compensating" => "33",
            _ => return phase.to_owned(),
        };
        self.paint(code, phase)
    }
    pub(super) fn dim(&self, s: &str) -> String {
        self.paint("2", s)
    }
    /// What needs a person's eye: bold red.
    pub(super) fn warn(&self, s: &str) -> String {
        self.paint("1;31", s)
    }
}

/// `5s`, `2m`, `3h`, `4d`, as `kubectl get` prints ages.
pub fn age(since: Timestamp, now: Timestamp) -> String {
    short(now.duration_since(since))
}

/// A duration in kubectl's short form.
pub fn short(d: SignedDuration) -> String {
    let s = d.as_secs().max(0);
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// Left-aligned columns separated by three spaces, like `kubectl get`.
pub fn table(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows.iter().map(Vec::len).max().unwrap_or(0))
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| visible_len(s))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            line.push_str(cell);
            if c + 1 < r.len() {
                let pad = widths[c] - visible_len(cell) + 3;
                line.push_str(&" ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn visible_len(s: &str) -> usize {
    let mut n = 0;
    let mut in_escape = false;
    for ch in s.chars() {
        match (in_escape, ch) {
            (false, '\x1b') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, _) => n += 1,
        }
    }
    n
}

/// At most `max` characters of `s`, with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_owned();
    }
    let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
    t.push('…');
    t
}

pub(super) fn mark(phase: StepPhase) -> &'static str {
    match phase {
        StepPhase::Succeeded => "✓",
        StepPhase::Failed => "✗",
        StepPhase::Running => "▶",
        StepPhase::WaitingForApproval => "?",
        StepPhase::Superseded => "~",
        StepPhase::Skipped => "-",
        StepPhase::Verifying => "?",
        StepPhase::Waiting => "◷",
        StepPhase::Pending => "·",
    }
}
