//! One person's view of the cluster: a client that acts as them, who the API
//! server says they are, and watches (as them) of the runs and Approvals
//! they may list. Locally there is one, the kubeconfig's user's; in the
//! cluster one per signed-in user (and namespace they chose), made on their
//! first request and dropped when nothing has used it for a while. A person
//! holds at most [`VIEWS_PER_USER`] at once, whatever cookies they send: the
//! watches are the API server's load and the console's memory.
//!
//! ```text
//!   request ─▶ authenticate ─▶ Who ─▶ Console::view_for ─▶ Arc<View>
//!                                        │ cache by who (per user+groups, per session) and chosen namespace;
//!                                        │ one view for who may list every namespace;
//!                                        │ ≤ VIEWS_PER_USER per user: the idle one used least recently goes, else 429
//!                                        └─ new: SelfSubjectReview, scope, 2 watches
//!   View ── client (impersonating / bearer token / kubeconfig)
//!        ├─ reflector AgentRuns ─┐
//!        ├─ reflector Approvals ─┴─▶ change counter ─▶ that user's SSE streams
//!        └─ history store (as the user)
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentrun_api::{AgentRun, Approval};
use agentrun_history::{ApiStore, Store};
use futures::StreamExt;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};

use super::auth::Who;
use super::namespace::Scope;
use super::pages;
use crate::client::{Error, whoami};
use crate::identity::Identity;

/// A view nobody has used for this long, with no page streaming from it,
/// is dropped (its watches stop).
pub(super) const IDLE: Duration = Duration::from_secs(10 * 60);

/// How long a new view waits for its first lists before the page renders.
const READY: Duration = Duration::from_secs(10);

/// Most views one user holds at once: one per namespace they chose and per
/// sign-in (a token session), each with two watches of its own. Past it the
/// one used least recently that no page streams from is dropped; when every
/// one streams, the request is refused (`429`).
pub const VIEWS_PER_USER: usize = 4;

/// What every handler reads and acts with: one person's client, identity
/// and watches.
pub struct View {
    pub client: Client,
    pub me: Identity,
    pub scope: Scope,
    /// Where finished runs' records are read (as the user; never written).
    pub history: Store,
    pub runs: reflector::Store<AgentRun>,
    pub approvals: reflector::Store<Approval>,
    pub changes: tokio::sync::watch::Sender<u64>,
    /// Decisions are offered (not the read-only view).
    pub decide: bool,
    /// A token-mode session's view: a sign-out button.
    pub session: bool,
    /// The user may not list every namespace and the console has no `-n`:
    /// they choose the one they see.
    pub choosable: bool,
    /// What each watch last failed with, until it succeeds again.
    trouble: Trouble,
    /// Set when the session behind the view ends: its streams close.
    pub(super) ended: tokio::sync::watch::Sender<bool>,
    watches: Vec<tokio::task::AbortHandle>,
    pub(super) used: Mutex<Instant>,
}

impl Drop for View {
    fn drop(&mut self) {
        for w in &self.watches {
            w.abort();
        }
    }
}

/// A watch's last error by what it watches, shown on every page.
type Trouble = Arc<Mutex<std::collections::BTreeMap<&'static str, String>>>;

/// The API server's own message where there is one.
fn said(e: &watcher::Error) -> String {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.message.clone(),
        watcher::Error::WatchError(s) => s.message.clone(),
        other => other.to_string(),
    }
}

fn note(trouble: &Trouble, what: &'static str, error: Option<String>) {
    if let Ok(mut t) = trouble.lock() {
        match error {
            Some(e) => t.insert(what, format!("watching {what}: {e}")),
            None => t.remove(what),
        };
    }
}

/// Keeps `writer`'s store in step with `api` (as the user), moves the change
/// counter on every event and every failure, records why the watch fails
/// while it does, and counts itself `heard` once its first list is in or
/// refused.
fn spawn_watch<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    what: &'static str,
    changes: tokio::sync::watch::Sender<u64>,
    trouble: Trouble,
    heard: tokio::sync::watch::Sender<u8>,
) -> tokio::task::AbortHandle
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    tokio::spawn(async move {
        let mut s = watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(|o: &mut K| o.meta_mut().managed_fields = None)
            .reflect(writer)
            .boxed();
        let mut first = true;
        while let Some(ev) = s.next().await {
            // Answered: the first list is complete, or refused.
            let answered = match ev {
                Ok(ev) => {
                    note(&trouble, what, None);
                    matches!(ev, watcher::Event::InitDone)
                }
                Err(e) => {
                    eprintln!("console: watching {what}: {}", said(&e));
                    note(&trouble, what, Some(said(&e)));
                    true
                }
            };
            changes.send_modify(|n| *n += 1);
            if first && answered {
                first = false;
                heard.send_modify(|n| *n += 1);
            }
        }
    })
    .abort_handle()
}

impl View {
    /// Asks the API server who `client` is, picks the scope (`namespace`;
    /// else all namespaces if they may list runs there; else `fallback` of
    /// who they are), starts the watches and waits (a while) for their first
    /// answers.
    pub async fn start(
        client: Client,
        namespace: Option<String>,
        fallback: impl FnOnce(&Identity) -> String,
        decide: bool,
        session: bool,
    ) -> Result<View, Error> {
        let me = whoami(&client).await?;
        let mut choosable = false;
        let scope = match namespace {
            Some(ns) => Scope::Namespace(ns),
            None => {
                let all = Api::<AgentRun>::all(client.clone());
                match all.list(&kube::api::ListParams::default().limit(1)).await {
                    Ok(_) => Scope::All,
                    Err(kube::Error::Api(s)) if s.code == 403 => {
                        choosable = true;
                        Scope::Namespace(fallback(&me))
                    }
                    Err(e) => return Err(crate::client::api("listing AgentRuns")(e)),
                }
            }
        };
        let (runs_api, apv_api): (Api<AgentRun>, Api<Approval>) = match &scope {
            Scope::All => (Api::all(client.clone()), Api::all(client.clone())),
            Scope::Namespace(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
        };
        let (changes, _) = tokio::sync::watch::channel(0u64);
        let (heard, mut heard_rx) = tokio::sync::watch::channel(0u8);
        let (runs, runs_w) = reflector::store();
        let (approvals, apv_w) = reflector::store();
        let trouble: Trouble = Arc::default();
        let watches = vec![
            spawn_watch(
                runs_api,
                runs_w,
                "AgentRuns",
                changes.clone(),
                trouble.clone(),
                heard.clone(),
            ),
            spawn_watch(
                apv_api,
                apv_w,
                "Approvals",
                changes.clone(),
                trouble.clone(),
                heard,
            ),
        ];
        // Serve once the first lists are in (or refused: a watch the API
        // server refuses shows on every page instead of holding it up).
        let _ = tokio::time::timeout(READY, heard_rx.wait_for(|n| *n >= 2)).await;
        let history = Store::Api(ApiStore::new(
            client.clone(),
            match &scope {
                Scope::Namespace(ns) => Some(ns.clone()),
                Scope::All => None,
            },
        ));
        Ok(View {
            client,
            me,
            scope,
            history,
            runs,
            approvals,
            changes,
            decide,
            session,
            choosable,
            trouble,
            ended: tokio::sync::watch::channel(false).0,
            watches,
            used: Mutex::new(Instant::now()),
        })
    }

    pub fn frame(&self) -> pages::Frame<'_> {
        let warnings = self
            .trouble
            .lock()
            .map(|t| t.values().cloned().collect())
            .unwrap_or_default();
        pages::Frame {
            me: &self.me,
            warnings,
            sign_out: self.session,
            namespace: match (&self.scope, self.choosable) {
                (Scope::Namespace(ns), true) => Some(ns),
                _ => None,
            },
        }
    }
    pub fn runs(&self) -> Vec<AgentRun> {
        self.runs.state().iter().map(|r| (**r).clone()).collect()
    }
    pub fn approvals(&self) -> Vec<Approval> {
        self.approvals
            .state()
            .iter()
            .map(|a| (**a).clone())
            .collect()
    }
    pub fn namespaces(&self) -> Vec<String> {
        let mut ns: Vec<String> = self
            .runs
            .state()
            .iter()
            .filter_map(|r| r.metadata.namespace.clone())
            .collect();
        ns.sort();
        ns.dedup();
        ns
    }
    pub fn run(&self, ns: &str, name: &str) -> Option<(AgentRun, Vec<Approval>)> {
        let run = self
            .runs
            .get(&reflector::ObjectRef::new(name).within(ns))
            .map(|r| (*r).clone())?;
        let uid = run.metadata.uid.clone().unwrap_or_default();
        let mut approvals: Vec<Approval> = self
            .approvals()
            .into_iter()
            .filter(|a| a.spec.run_uid == uid)
            .collect();
        approvals.sort_by_key(|a| a.metadata.creation_timestamp.as_ref().map(|t| t.0));
        Some((run, approvals))
    }

    /// Closes when the session behind the view ends (never for the others).
    pub fn ended(&self) -> tokio::sync::watch::Receiver<bool> {
        self.ended.subscribe()
    }

    pub(super) fn touch(&self) {
        if let Ok(mut used) = self.used.lock() {
            *used = Instant::now();
        }
    }
}

/// A signed-in user, and the namespace they chose (if they may not list
/// every one).
pub(super) type Key = (Who, Option<String>);

/// A view, made on its first request.
pub(super) struct Cell {
    /// The user it acts for (their name, whatever their groups or session),
    /// counted against [`VIEWS_PER_USER`].
    pub(super) user: String,
    pub(super) view: Arc<tokio::sync::OnceCell<Arc<View>>>,
}

impl Cell {
    /// Nobody holds it but the cache: no page streams from it and no request
    /// is making or using it.
    pub(super) fn unheld(&self) -> bool {
        Arc::strong_count(&self.view) == 1
            && self.view.get().is_none_or(|v| Arc::strong_count(v) == 1)
    }

    pub(super) fn last_used(&self) -> Option<Instant> {
        self.view.get().and_then(|v| v.used.lock().ok().map(|u| *u))
    }
}

pub(super) type Cells = HashMap<Key, Cell>;

/// Why a request has no view.
pub enum NoView {
    /// The user already holds [`VIEWS_PER_USER`] views, each in use.
    Full,
    Failed(Error),
}

impl From<Error> for NoView {
    fn from(e: Error) -> NoView {
        NoView::Failed(e)
    }
}

/// Makes room for one more view of `user`: drops their views nobody holds,
/// the least recently used first, until they hold fewer than
/// [`VIEWS_PER_USER`]; `false` when every one is in use.
pub(super) fn make_room(cells: &mut Cells, user: &str) -> bool {
    loop {
        let theirs: Vec<(&Key, &Cell)> = cells.iter().filter(|(_, c)| c.user == user).collect();
        if theirs.len() < VIEWS_PER_USER {
            return true;
        }
        let Some(key) = theirs
            .iter()
            .filter(|(_, c)| c.unheld())
            .min_by_key(|(_, c)| c.last_used())
            .map(|(k, _)| (*k).clone())
        else {
            return false;
        };
        cells.remove(&key);
    }
}

/// The views of the signed-in users, by who they are.
#[derive(Default)]
pub struct Views {
    pub(super) by_who: Mutex<Cells>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cells of `user`, one per namespace in `namespaces`, each held by the
    /// returned handles (as a request or a page's stream would).
    fn cells(
        cells: &mut Cells,
        user: &str,
        namespaces: &[&str],
    ) -> Vec<Arc<tokio::sync::OnceCell<Arc<View>>>> {
        namespaces
            .iter()
            .map(|ns| {
                let view: Arc<tokio::sync::OnceCell<Arc<View>>> = Arc::default();
                let who = Who::Proxy(Identity {
                    user: user.into(),
                    groups: vec![],
                });
                cells.insert(
                    (who, Some((*ns).to_owned())),
                    Cell {
                        user: user.into(),
                        view: view.clone(),
                    },
                );
                view
            })
            .collect()
    }

    #[test]
    fn a_user_holds_at_most_the_bound_and_only_unheld_views_make_room() {
        let mut all = Cells::new();
        let mut alice = cells(&mut all, "alice", &["a", "b", "c", "d"]);
        let _bob = cells(&mut all, "bob", &["a", "b", "c", "d"]);
        assert_eq!(VIEWS_PER_USER, 4);
        assert!(
            !make_room(&mut all, "alice"),
            "each of alice's views is in use"
        );
        assert!(make_room(&mut all, "carol"), "others' views do not count");
        // One of alice's pages closes: that view goes, the others stay.
        drop(alice.remove(1));
        assert!(make_room(&mut all, "alice"));
        let left: Vec<&str> = {
            let mut v: Vec<&str> = all
                .iter()
                .filter(|(_, c)| c.user == "alice")
                .filter_map(|((_, ns), _)| ns.as_deref())
                .collect();
            v.sort();
            v
        };
        assert_eq!(left, ["a", "c", "d"]);
        assert_eq!(all.iter().filter(|(_, c)| c.user == "bob").count(), 4);
    }
}
