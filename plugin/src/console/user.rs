//! From a request to the person it acts for: [`Console::view_for`] makes or
//! finds their [`View`] (bounded by [`VIEWS_PER_USER`]), and the [`User`]
//! extractor hands it to every handler.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use kube::Client;

use super::auth::{Auth, Who};
use super::namespace::{NAMESPACE_COOKIE, Scope, namespace_name};
use super::state::{Console, Shared};
use super::view::{Cell, Cells, IDLE, NoView, VIEWS_PER_USER, View, make_room};
use crate::client::Error;
use crate::identity::Identity;

impl Console {
    /// The view that acts for `who`: the kubeconfig user's, or the signed-in
    /// user's (made on first use), in the namespace they `chose` if they may
    /// not list every one. The one place a request's identity becomes a
    /// client, and where a user's views are bounded ([`VIEWS_PER_USER`]).
    pub async fn view_for(&self, who: &Who, chose: Option<&str>) -> Result<Arc<View>, NoView> {
        if let (Who::Local, Some(v)) = (who, &self.local) {
            return Ok(v.clone());
        }
        let user = self.user_of(who)?;
        let chose = chose.filter(|_| self.namespace.is_none());
        let cell = {
            let mut by_who = self
                .views
                .by_who
                .lock()
                .map_err(|_| Error::Usage("the console's views are poisoned".into()))?;
            self.sweep(&mut by_who);
            // Who may list every namespace sees them all whatever they chose:
            // one view, not one per namespace cookie.
            let everywhere = by_who.iter().find_map(|((w, _), c)| {
                c.view
                    .get()
                    .filter(|v| w == who && matches!(v.scope, Scope::All))
                    .cloned()
            });
            if let Some(v) = everywhere {
                v.touch();
                return Ok(v);
            }
            let key = (who.clone(), chose.map(str::to_owned));
            if !by_who.contains_key(&key) {
                if !make_room(&mut by_who, &user) {
                    return Err(NoView::Full);
                }
                by_who.insert(
                    key.clone(),
                    Cell {
                        user,
                        view: Arc::default(),
                    },
                );
            }
            by_who[&key].view.clone()
        };
        let view = cell
            .get_or_try_init(|| async {
                let (client, session) = match who {
                    // Only a local console ties requests to the kubeconfig's user.
                    Who::Local => return Err(Error::Refused("not a local console".into())),
                    Who::Proxy(id) => (self.impersonating(id)?, false),
                    Who::Session(sid) => {
                        let token = match &self.auth {
                            Auth::Users {
                                sessions: Some(s), ..
                            } => s.get(sid).map(|s| s.token),
                            _ => None,
                        }
                        .ok_or_else(|| Error::Refused("the session has ended".into()))?;
                        (self.token_client(&token)?, true)
                    }
                };
                // What they chose; else a ServiceAccount's own namespace;
                // else the console's.
                let fallback = |me: &Identity| {
                    chose
                        .map(str::to_owned)
                        .or_else(|| super::namespace::own_namespace(&me.user))
                        .unwrap_or_else(|| self.default_namespace.clone())
                };
                let v = View::start(
                    client,
                    self.namespace.clone(),
                    fallback,
                    self.decide,
                    session,
                )
                .await?;
                eprintln!("console: serving {} (as themselves)", v.me.user);
                Ok::<_, Error>(Arc::new(v))
            })
            .await?
            .clone();
        view.touch();
        Ok(view)
    }

    /// The name of the user `who` acts for: the proxy's, or the one the API
    /// server gave the session's token at sign-in.
    fn user_of(&self, who: &Who) -> Result<String, Error> {
        match (who, &self.auth) {
            (Who::Proxy(id), _) => Ok(id.user.clone()),
            (
                Who::Session(sid),
                Auth::Users {
                    sessions: Some(s), ..
                },
            ) => s
                .get(sid)
                .map(|s| s.user)
                .ok_or_else(|| Error::Refused("the session has ended".into())),
            _ => Err(Error::Refused("not a local console".into())),
        }
    }

    /// Drops `who`'s views (a session that ended) and closes their streams.
    pub fn forget(&self, who: &Who) {
        if let Ok(mut by_who) = self.views.by_who.lock() {
            by_who.retain(|(w, _), cell| {
                if w != who {
                    return true;
                }
                if let Some(v) = cell.view.get() {
                    v.ended.send_replace(true);
                }
                false
            });
        }
    }

    /// Drops the views no page streams from that have been idle, those of
    /// sessions that ended, and those whose making failed.
    fn sweep(&self, by_who: &mut Cells) {
        let now = Instant::now();
        by_who.retain(|(who, _), cell| {
            let Some(v) = cell.view.get() else {
                // Being made, or its making failed (nobody holds it then).
                return !cell.unheld();
            };
            let live_session = match (who, &self.auth) {
                (
                    Who::Session(id),
                    Auth::Users {
                        sessions: Some(s), ..
                    },
                ) => s.get(id).is_some(),
                _ => true,
            };
            if !live_session {
                v.ended.send_replace(true);
                return false;
            }
            let idle = v
                .used
                .lock()
                .map(|u| now.duration_since(*u) > IDLE)
                .unwrap_or(true);
            !(idle && cell.unheld())
        });
    }

    /// A client that acts as `id` (Impersonate-User and -Group headers on
    /// the console's own credentials).
    fn impersonating(&self, id: &Identity) -> Result<Client, Error> {
        let mut config = self.config.clone();
        config.auth_info.impersonate = Some(id.user.clone());
        config.auth_info.impersonate_groups = (!id.groups.is_empty()).then(|| id.groups.clone());
        Client::try_from(config).map_err(|e| Error::Config(e.to_string()))
    }

    /// A client that authenticates with `token` alone (none of the
    /// console's own credentials).
    pub fn token_client(&self, token: &str) -> Result<Client, Error> {
        let mut config = self.config.clone();
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.to_owned().into()),
            ..Default::default()
        };
        Client::try_from(config).map_err(|e| Error::Config(e.to_string()))
    }
}

/// The view of the person a request acts for: every handler takes this
/// (`User(c)`), so every read and write is made as them.
pub struct User(pub Arc<View>);

impl FromRequestParts<Shared> for User {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, c: &Shared) -> Result<User, Response> {
        let Some(who) = parts.extensions.get::<Who>().cloned() else {
            return Err(StatusCode::UNAUTHORIZED.into_response());
        };
        let chose =
            super::auth::cookie(&parts.headers, NAMESPACE_COOKIE).filter(|ns| namespace_name(ns));
        match c.view_for(&who, chose).await {
            Ok(v) => Ok(User(v)),
            Err(NoView::Full) => {
                eprintln!(
                    "console: {} holds {VIEWS_PER_USER} views, each in use; refused another",
                    who.label()
                );
                Err((
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "You have {VIEWS_PER_USER} views of the cluster open in this console (one per namespace you chose and per sign-in), each on a page that is open: close one of those pages, then reload this one."
                    ),
                )
                    .into_response())
            }
            Err(NoView::Failed(e)) => {
                eprintln!("console: acting for {}: {e}", who.label());
                Err((
                    StatusCode::FORBIDDEN,
                    format!("The console cannot act for you: {e}"),
                )
                    .into_response())
            }
        }
    }
}
