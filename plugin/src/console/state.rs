//! What every request of the console shares: how it was asked to run, how
//! people sign in, and their views.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::auth::{Auth, Mode};
use super::open;
use super::view::{self, View};

/// How `kubectl agentrun console` was asked to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// `-n`: one namespace; none: all the user may list, else the context's.
    pub namespace: Option<String>,
    /// 127.0.0.1 and a free port unless `--listen` / `--port`.
    pub address: SocketAddr,
    pub open: bool,
    /// No decisions: no forms, no write route.
    pub read_only: bool,
    /// How people sign in; none: the kubeconfig's user, on loopback only.
    pub auth: Vec<Mode>,
    /// `--auth proxy`: the peers whose user headers are believed.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    pub user_header: String,
    pub group_header: String,
    pub user_prefix: String,
    pub group_prefix: String,
    /// `--auth token`: how long a session lasts.
    pub session_ttl: Duration,
}

/// What every request shares: how people sign in, the console's own
/// configuration (to build each person's client from), and their views.
pub struct Console {
    pub(super) auth: Auth,
    /// The console's own kubeconfig or ServiceAccount; in the cluster it
    /// only ever impersonates or carries a user's token.
    pub(super) config: kube::Config,
    /// The kubeconfig user's view (local mode).
    pub(super) local: Option<Arc<View>>,
    pub(super) views: view::Views,
    /// `-n`, for every view.
    pub(super) namespace: Option<String>,
    /// Where a view looks when its user may not list every namespace.
    pub(super) default_namespace: String,
    pub(super) port: u16,
    /// Decisions are offered (not the read-only view).
    pub(super) decide: bool,
    /// Local mode: requests must name 127.0.0.1 or localhost (no DNS
    /// rebinding onto the kubeconfig's credentials).
    pub(super) loopback: bool,
    /// `--open`'s page with the tokened URL, until the browser has used it.
    pub(super) launch: std::sync::Mutex<Option<open::LaunchPage>>,
}

impl Console {
    /// Removes `--open`'s page (the token was traded, time is up, or the
    /// console stops).
    pub(super) fn launched(&self) {
        let page = self.launch.lock().ok().and_then(|mut l| l.take());
        drop(page);
    }
}

pub type Shared = Arc<Console>;
