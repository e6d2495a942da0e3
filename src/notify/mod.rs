//! Approval notifications: tell people that a run waits for them, remind
//! others when nobody decides, and say what was decided — with the same
//! durability as a run's checkpoints.
//!
//! ```text
//!   Secret (channels.yaml) ──watch──▶ Channels ─┐ reload: look at every approval again
//!   watch Approval ─────────────────────────────┴─▶ reconcile(approval)
//!        plan (pure) → for each due delivery: render → guard → POST → record
//!        → server-side apply of status.notifications + Notified (field manager
//!          agentrun-operator-notifier) after every attempt
//! ```
//!
//! Each delivery (approval × event × channel) has a stable id, sent as
//! `X-AgentRun-Delivery`, and a record in the Approval's status written after
//! every attempt. A restarted operator resumes what is pending and never
//! sends a delivered one again; only a crash between a send and its record
//! repeats it, with the same id, so the receiver can drop the repeat.
//! Channels are the platform team's (a Secret); a run only names them.
//! While an approval owes a notification the notifier holds a finalizer
//! ([`FINALIZER`]) on it, so a run deleted as soon as it finishes still has
//! its decision told; the finalizer goes once nothing is owed.

pub mod channels;
pub mod guard;
pub mod message;
pub mod plan;
pub mod send;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration as StdDuration;

use futures::StreamExt;
use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::api::{Approval, Delivery, DeliveryState};
use crate::metrics::{ChannelLabel, Metrics, NotificationLabels};
use channels::Channels;
use guard::Guard;

/// The field manager of the notifier's status writes.
pub const FIELD_MANAGER: &str = "agentrun-operator-notifier";
/// Held on an Approval while it owes a notification (its outcome, a
/// delivery under way), so a run deleted at once (`ttlSecondsAfterFinished:
/// 0`) does not take its final notification with it.
pub const FINALIZER: &str = "agentrun.dev/notifications";
/// Approvals notified at once (a slow receiver holds up only its own).
const CONCURRENT: u16 = 8;

/// How the notifier is set up (`--notify-secret`, `--notify-allow-cidr`,
/// `--console-url`).
#[derive(Clone, Debug)]
pub struct Settings {
    /// The channel Secret's namespace and name.
    pub secret_namespace: String,
    pub secret_name: String,
    pub allow: Vec<IpNet>,
    pub console_url: Option<String>,
}

impl Settings {
    fn source(&self) -> String {
        format!("{}/{}", self.secret_namespace, self.secret_name)
    }
}

/// Publishes an Event (the controller's sink, shared).
pub type Publish = Arc<dyn Fn(Event, ObjectReference) + Send + Sync>;
/// Called right after a send, before its record is written (the fault
/// tests' crash point).
pub type AfterSend = fn();

struct Ctx {
    client: Client,
    settings: Settings,
    guard: Guard,
    channels: tokio::sync::watch::Receiver<Option<Arc<Channels>>>,
    metrics: Arc<Metrics>,
    publish: Publish,
    after_send: AfterSend,
    /// The notifications this process last wrote per approval UID: newer
    /// than the cache until the watch shows the write, so a reconcile on
    /// an older copy never sends a delivered notification again.
    written: Mutex<HashMap<String, Vec<Delivery>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("recording notifications on approval {approval}: {source}")]
    Write {
        approval: String,
        #[source]
        source: kube::Error,
    },
    #[error("{what} the notification finalizer on approval {approval}: {source}")]
    Finalizer {
        what: &'static str,
        approval: String,
        #[source]
        source: kube::Error,
    },
    #[error("approval has no {0}")]
    Metadata(&'static str),
}

/// Runs the notifier until `shutdown` resolves.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    settings: Settings,
    metrics: Arc<Metrics>,
    publish: Publish,
    after_send: AfterSend,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    // reqwest's TLS takes the process's crypto provider; kube brings ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let guard = Guard {
        allow: settings.allow.clone(),
        services: service_cidrs(&client).await,
    };
    let (tx, rx) = tokio::sync::watch::channel(None);
    tokio::spawn(watch_channels(client.clone(), settings.clone(), tx));
    let approvals: Api<Approval> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let reload = changes(rx.clone());
    let ctx = Arc::new(Ctx {
        client,
        settings,
        guard,
        channels: rx,
        metrics,
        publish,
        after_send,
        written: Mutex::new(HashMap::new()),
    });
    info!(secret = %ctx.settings.source(), "notifier started");
    Controller::new(approvals, watcher::Config::default())
        .with_config(controller::Config::default().concurrency(CONCURRENT))
        .reconcile_all_on(reload)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(controller::Error::ReconcilerFailed(err, obj)) = r {
                warn!(approval = %obj, error = %err, "notifying failed");
            }
        })
        .await;
}

/// A stream that yields whenever the channels change.
fn changes(
    rx: tokio::sync::watch::Receiver<Option<Arc<Channels>>>,
) -> impl futures::Stream<Item = ()> + Send {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.changed().await.ok()?;
        Some(((), rx))
    })
}

/// Watches the one channel Secret; every change is parsed and published.
async fn watch_channels(
    client: Client,
    settings: Settings,
    tx: tokio::sync::watch::Sender<Option<Arc<Channels>>>,
) {
    let source = settings.source();
    let secrets: Api<Secret> = Api::namespaced(client, &settings.secret_namespace);
    let config =
        watcher::Config::default().fields(&format!("metadata.name={}", settings.secret_name));
    let mut seen = false;
    let mut events = watcher(secrets, config).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let parsed = match event {
            Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => {
                seen = true;
                let data = s
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect();
                Channels::parse(&source, &data)
            }
            Ok(watcher::Event::Delete(_)) => {
                seen = false;
                Channels::unusable(&source, format!("Secret {source} does not exist"))
            }
            Ok(watcher::Event::Init) => continue,
            Ok(watcher::Event::InitDone) if seen => continue,
            Ok(watcher::Event::InitDone) => {
                Channels::unusable(&source, format!("Secret {source} does not exist"))
            }
            Err(e) => {
                warn!(secret = %source, error = %e, "watching the notification channels");
                continue;
            }
        };
        info!(secret = %source, "notification channels loaded");
        tx.send_replace(Some(Arc::new(parsed)));
    }
}

/// The cluster's Service CIDRs, when this operator may list them.
async fn service_cidrs(client: &Client) -> Vec<IpNet> {
    let api: Api<k8s_openapi::api::networking::v1::ServiceCIDR> = Api::all(client.clone());
    match api.list(&ListParams::default()).await {
        Ok(list) => list
            .items
            .iter()
            .flat_map(|s| s.spec.iter().flat_map(|s| s.cidrs.iter().flatten()))
            .filter_map(|c| c.parse().ok())
            .collect(),
        Err(e) => {
            warn!(error = %e, "cannot list ServiceCIDRs; Service addresses in private ranges are refused anyway");
            Vec::new()
        }
    }
}

fn reference(a: &Approval) -> ObjectReference {
    a.object_ref(&())
}

fn run_reference(a: &Approval) -> ObjectReference {
    ObjectReference {
        api_version: Some("agentrun.dev/v1alpha1".into()),
        kind: Some("AgentRun".into()),
        name: Some(a.spec.run_name.clone()),
        namespace: a.metadata.namespace.clone(),
        uid: Some(a.spec.run_uid.clone()),
        ..ObjectReference::default()
    }
}

async fn reconcile(a: Arc<Approval>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let uid = a.uid().ok_or(Error::Metadata("uid"))?;
    let channels = {
        let mut rx = ctx.channels.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(c) => c.clone().expect("waited for Some"),
            Err(_) => return Ok(Action::await_change()),
        }
    };
    // The freshest record of what was sent: this process's own last write
    // until the cache shows it.
    let mut approval = (*a).clone();
    {
        let status = approval.status.get_or_insert_with(Default::default);
        let mut written = ctx.written.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mine) = written.get(&uid) {
            if progress(mine) == progress(&status.notifications) {
                // The cache has caught up (times come back at the API's precision).
                written.remove(&uid);
            } else {
                status.notifications = mine.clone();
            }
        }
    }
    let recorded = approval
        .status
        .as_ref()
        .map(|s| s.notifications.clone())
        .unwrap_or_default();
    let mut deliveries = recorded.clone();
    let previous = approval
        .status
        .iter()
        .flat_map(|s| s.conditions.iter())
        .find(|c| c.type_ == plan::CONDITION)
        .cloned();
    let now = Timestamp::now();
    let mut finalizers = approval.finalizers().to_vec();
    if approval.metadata.deletion_timestamp.is_none()
        && !finalizers.iter().any(|f| f == FINALIZER)
        && plan::owes(&approval, &channels, now)
    {
        finalizers = hold(&ctx, &approval).await?;
    }
    let p = plan::plan(&approval, &channels, now);
    let mut wake = p.wake;
    let mut wrote = false;

    for d in p.settle {
        warn_once(&ctx, &approval, &deliveries, &d);
        upsert(&mut deliveries, d);
        write(&ctx, &approval, &deliveries, previous.as_ref()).await?;
        wrote = true;
    }
    for (w, d) in p.due {
        let Ok(channel) = channels.get(&w.channel) else {
            continue;
        };
        let (body, content_type) = message::render(
            channel.format,
            &message::Facts {
                approval: &approval,
                event: w.event,
                delivery_id: &w.id,
                occurred_at: w.occurred_at,
                console_url: ctx.settings.console_url.as_deref(),
            },
        );
        let outcome = send::send(
            channel,
            &ctx.guard,
            &send::Message {
                delivery_id: &w.id,
                event: w.event.as_str(),
                body: &body,
                content_type,
            },
        )
        .await;
        (ctx.after_send)();
        let done = Timestamp::now();
        let d = plan::record(d, &outcome, channel.max_attempts, done);
        let label = match (&outcome, d.state) {
            (send::Outcome::Delivered, _) => "delivered",
            (send::Outcome::Refused(_), _) => "refused",
            (_, DeliveryState::Pending) => "retry",
            _ => "failed",
        };
        ctx.metrics
            .notifications
            .get_or_create(&NotificationLabels {
                channel: w.channel.clone(),
                outcome: label.into(),
            })
            .inc();
        if d.state == DeliveryState::Delivered {
            let secs = done.duration_since(w.occurred_at).as_secs_f64().max(0.0);
            ctx.metrics
                .notification_latency
                .get_or_create(&ChannelLabel {
                    channel: w.channel.clone(),
                })
                .observe(secs);
            debug!(delivery = %d.id, attempts = d.attempts, "notification delivered");
        }
        if let Some(next) = d.next_attempt_at.as_ref().map(|t| t.0) {
            wake = Some(wake.map_or(next, |w| w.min(next)));
        }
        warn_once(&ctx, &approval, &deliveries, &d);
        upsert(&mut deliveries, d);
        write(&ctx, &approval, &deliveries, previous.as_ref()).await?;
        wrote = true;
    }
    // A record this process holds that an earlier write did not get to the
    // API server (it failed) is written now, so a restart does not send it
    // again.
    let cached = a
        .status
        .as_ref()
        .map(|s| s.notifications.as_slice())
        .unwrap_or_default();
    if !wrote
        && (progress(&deliveries) != progress(cached) || needs_condition(&approval, &deliveries))
    {
        write(&ctx, &approval, &deliveries, previous.as_ref()).await?;
    }
    if finalizers.iter().any(|f| f == FINALIZER) {
        let mut after = approval.clone();
        after
            .status
            .get_or_insert_with(Default::default)
            .notifications = deliveries.clone();
        if !plan::owes(&after, &channels, Timestamp::now()) {
            release(&ctx, &approval, &finalizers).await?;
        }
    }
    Ok(match wake {
        Some(at) => {
            let secs = at.duration_since(Timestamp::now()).as_secs_f64().max(0.05);
            Action::requeue(StdDuration::from_secs_f64(secs))
        }
        None => Action::await_change(),
    })
}

/// Adds [`FINALIZER`], guarded by what the list held when read; returns
/// the list as the API server now holds it.
async fn hold(ctx: &Ctx, a: &Approval) -> Result<Vec<String>, Error> {
    let name = a.name_any();
    let ns = a.namespace().ok_or(Error::Metadata("namespace"))?;
    let ops = match a.metadata.finalizers.as_deref() {
        None | Some([]) => json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": a.resource_version()},
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
        ]),
        Some(current) => json!([
            {"op": "test", "path": "/metadata/finalizers", "value": current},
            {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER},
        ]),
    };
    let patch: json_patch::Patch = serde_json::from_value(ops).expect("a JSON patch");
    let api: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    let held = api
        .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
        .map_err(|source| Error::Finalizer {
            what: "adding",
            approval: format!("{ns}/{name}"),
            source,
        })?;
    Ok(held.finalizers().to_vec())
}

/// Removes [`FINALIZER`] from `current` (what the API server last said).
async fn release(ctx: &Ctx, a: &Approval, current: &[String]) -> Result<(), Error> {
    let name = a.name_any();
    let ns = a.namespace().ok_or(Error::Metadata("namespace"))?;
    let rest: Vec<&String> = current.iter().filter(|f| *f != FINALIZER).collect();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": current},
        {"op": "replace", "path": "/metadata/finalizers", "value": rest},
    ]))
    .expect("a JSON patch");
    let api: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    match api
        .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(Error::Finalizer {
            what: "removing",
            approval: format!("{ns}/{name}"),
            source,
        }),
    }
}

/// What a record says was done, without its times.
fn progress(ds: &[Delivery]) -> Vec<(&str, DeliveryState, u32, Option<&str>)> {
    ds.iter()
        .map(|d| (d.id.as_str(), d.state, d.attempts, d.reason.as_deref()))
        .collect()
}

fn upsert(deliveries: &mut Vec<Delivery>, d: Delivery) {
    match deliveries.iter_mut().find(|x| x.id == d.id) {
        Some(x) => *x = d,
        None => deliveries.push(d),
    }
}

/// Whether the condition on the approval differs from what the records say.
fn needs_condition(a: &Approval, deliveries: &[Delivery]) -> bool {
    let status = a.status.clone().unwrap_or_default();
    let previous = status
        .conditions
        .iter()
        .find(|c| c.type_ == plan::CONDITION);
    let want = plan::condition(
        deliveries,
        previous,
        a.metadata.generation,
        Timestamp::now(),
    );
    match (previous, want) {
        (None, None) => false,
        (Some(p), Some(w)) => {
            p.status != w.status || p.reason != w.reason || p.message != w.message
        }
        _ => true,
    }
}

/// Server-side applies every notification record and the condition.
async fn write(
    ctx: &Ctx,
    a: &Approval,
    deliveries: &[Delivery],
    previous: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
) -> Result<(), Error> {
    let name = a.name_any();
    let ns = a.namespace().ok_or(Error::Metadata("namespace"))?;
    let condition = plan::condition(
        deliveries,
        previous,
        a.metadata.generation,
        Timestamp::now(),
    );
    let patch = json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "Approval",
        "metadata": {"name": name},
        "status": {
            "notifications": deliveries,
            "conditions": condition.into_iter().collect::<Vec<_>>(),
        },
    });
    // Known to this process from now on, whether or not the write below
    // gets through: a failed write is retried, never the send.
    if let Some(uid) = a.uid() {
        ctx.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid, deliveries.to_vec());
    }
    let api: Api<Approval> = Api::namespaced(ctx.client.clone(), &ns);
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(|source| Error::Write {
        approval: format!("{ns}/{name}"),
        source,
    })?;
    Ok(())
}

/// A Warning Event when a delivery first meets a problem (or a new one):
/// on the approval, and for a channel that is not configured on the run
/// too, where the run's author looks.
fn warn_once(ctx: &Ctx, a: &Approval, before: &[Delivery], d: &Delivery) {
    let old = before.iter().find(|x| x.id == d.id);
    let waits_for_config = d.state == DeliveryState::Pending
        && matches!(
            d.reason.as_deref(),
            Some("ChannelUnknown" | "ChannelInvalid" | "ChannelsUnreadable")
        );
    let troubled = d.state == DeliveryState::Failed || waits_for_config;
    if !troubled || old.is_some_and(|o| o.reason == d.reason && o.last_error == d.last_error) {
        return;
    }
    let reason = d
        .reason
        .clone()
        .unwrap_or_else(|| "NotificationFailed".into());
    let note = format!(
        "{} notification to channel {}: {}",
        d.event.as_str(),
        d.channel,
        d.last_error.as_deref().unwrap_or("not delivered")
    );
    warn!(approval = %a.name_any(), delivery = %d.id, %reason, "{note}");
    let event = || Event {
        type_: EventType::Warning,
        reason: reason.clone(),
        note: Some(note.clone()),
        action: "Notify".into(),
        secondary: None,
    };
    if reason == "ChannelUnknown" {
        (ctx.publish)(event(), run_reference(a));
    }
    (ctx.publish)(event(), reference(a));
}

fn error_policy(_a: Arc<Approval>, err: &Error, _ctx: Arc<Ctx>) -> Action {
    debug!(error = %err, "notifier backing off");
    Action::requeue(StdDuration::from_secs(5))
}

/// Parses a `--notify-secret` value `NAMESPACE/NAME`.
pub fn parse_secret_ref(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err(format!(
            "--notify-secret {s:?}: write NAMESPACE/NAME, e.g. agentrun-system/agentrun-notifications"
        )),
    }
}
