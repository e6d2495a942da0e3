//! Live updates: each page holds one Server-Sent Events stream that sends its
//! live fragment again whenever the watches see a change (and once on
//! connect, so nothing between the page load and the stream is missed).
//! No polling: the stream waits on the watches' change counter.

use std::convert::Infallible;
use std::time::Duration;

use std::sync::Arc;

use axum::extract::{Path, Query};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use jiff::Timestamp;
use maud::Markup;

use super::filter::RunFilter;
use super::user::User;
use super::view::View;
use super::{pages, run_page};
use crate::client::{events_of, journals_of, signals_of};

/// Bursts of changes (a status write and its Events) render once.
const SETTLE: Duration = Duration::from_millis(100);

/// A stream of `name` events, each `render()`ed after a change in the
/// user's own watches; it ends when their session does.
fn stream<F, Fut>(
    c: Arc<View>,
    name: &'static str,
    render: F,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    F: Fn(Arc<View>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Markup> + Send + 'static,
{
    let rx = c.changes.subscribe();
    let ended = c.ended();
    let s = futures::stream::unfold(
        (c, rx, ended, true),
        move |(c, mut rx, mut ended, first)| {
            let r = render(c.clone());
            async move {
                if *ended.borrow() {
                    return None;
                }
                if !first {
                    tokio::select! {
                        changed = rx.changed() => changed.ok()?,
                        _ = ended.changed() => return None,
                    }
                    tokio::time::sleep(SETTLE).await;
                    rx.borrow_and_update();
                }
                let html = r.await.into_string();
                Some((
                    Ok(Event::default().event(name).data(html)),
                    (c, rx, ended, false),
                ))
            }
        },
    );
    Sse::new(s).keep_alive(KeepAlive::default())
}

pub async fn runs(
    User(c): User,
    Query(f): Query<RunFilter>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    stream(c, "runs", move |c| {
        let f = f.clone();
        async move { pages::runs_table(&c.runs(), &c.approvals(), &f, Timestamp::now()) }
    })
}

pub async fn approvals(User(c): User) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    stream(c, "inbox", |c| async move {
        pages::inbox(&c.me, &c.approvals(), Timestamp::now(), c.decide)
    })
}

pub async fn run(
    User(c): User,
    Path((ns, name)): Path<(String, String)>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    stream(c, "run", move |c| {
        let (ns, name) = (ns.clone(), name.clone());
        async move {
            match c.run(&ns, &name) {
                Some((r, approvals)) => {
                    let events = events_of(&c.client, &ns, &name).await.unwrap_or_default();
                    let signals = signals_of(&c.client, &ns, &r).await;
                    let journals = journals_of(&c.client, &ns, &r).await.unwrap_or_default();
                    let related = crate::render::Related {
                        approvals: &approvals,
                        signals: &signals,
                        journals: &journals,
                        events: &events,
                    };
                    run_page::run_detail(&r, &related, c.decide, Timestamp::now())
                }
                None => {
                    maud::html! { p class="empty" { "The run is gone (deleted, or its TTL passed)." } }
                }
            }
        }
    })
}
