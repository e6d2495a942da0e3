//! `kubectl agentrun watch RUN`: follow one run until it finishes.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use agentrun_api::RunPhase;
use jiff::Timestamp;
use kube::Client;

use super::style;
use crate::client::{Error, journals_of, run_and_approvals, signals_of};
use crate::render;

pub async fn watch(client: &Client, ns: &str, run: &str) -> Result<(), Error> {
    let tty = std::io::stdout().is_terminal();
    let mut last = String::new();
    loop {
        let (r, approvals) = run_and_approvals(client, ns, run).await?;
        let now = Timestamp::now();
        let terminal = r
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(RunPhase::is_terminal);
        if tty {
            let signals = signals_of(client, ns, &r).await;
            let journals = journals_of(client, ns, &r).await.unwrap_or_default();
            let related = render::Related {
                approvals: &approvals,
                signals: &signals,
                journals: &journals,
                events: &[],
            };
            let view = render::describe(&r, &related, now, false, style());
            print!("\x1b[2J\x1b[H{view}");
            std::io::stdout().flush()?;
        } else {
            let s = r.status.clone().unwrap_or_default();
            let line = format!(
                "{} {} step {} progress {}",
                run,
                s.phase.map(|p| format!("{p:?}")).unwrap_or_default(),
                s.current_step.unwrap_or_else(|| "-".into()),
                s.progress.unwrap_or_else(|| "-".into())
            );
            if line != last {
                println!("{line}");
                last = line;
            }
        }
        if terminal {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
