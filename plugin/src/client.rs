//! The plugin's ground floor: the client and the namespace from the
//! kubeconfig (or the Pod's ServiceAccount), the error every command returns,
//! and the reads every view needs: who the user is, a run with its
//! approvals, its Events, its Signals and its steps' journals.

use agentrun_api::labels;
use agentrun_api::{AgentRun, Approval, Signal, StepJournal};
use clap::Args;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config, ResourceExt};

use crate::identity::Identity;

/// The writer the plugin's patches name in `managedFields`, as kubectl's own
/// commands name theirs (`kubectl-patch`, `kubectl-edit`).
const FIELD_MANAGER: &str = "kubectl-agentrun";

pub(crate) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// The flags kubectl users expect on every command.
#[derive(Args, Debug, Clone, Default)]
pub struct Global {
    /// The namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Path to the kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Act as this user (impersonation, like kubectl --as).
    #[arg(long = "as", global = true)]
    pub as_user: Option<String>,
    /// Act as a member of this group (repeatable, like kubectl --as-group).
    #[arg(long = "as-group", global = true)]
    pub as_group: Vec<String>,
}

/// What went wrong; every message names the object and the next step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Refused(String),
    /// Input the command cannot use (exit 1, checked before any request).
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("kubeconfig: {0}")]
    Config(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// 2 for usage, 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => 2,
            _ => 1,
        }
    }
}

pub(crate) fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| match &source {
        kube::Error::Api(s) => Error::Refused(format!("{what}: {}", s.message)),
        _ => Error::Api { what, source },
    }
}

/// The client, and the namespace the command works in.
pub async fn connect(g: &Global) -> Result<(Client, String), Error> {
    let (config, namespace) = config(g).await?;
    let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    Ok((client, namespace))
}

/// The configuration `connect` makes its client from (the console makes
/// more: one per signed-in user).
pub async fn config(g: &Global) -> Result<(Config, String), Error> {
    let opts = KubeConfigOptions {
        context: g.context.clone(),
        ..KubeConfigOptions::default()
    };
    let mut config = match &g.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| Error::Config(e.to_string()))?;
            Config::from_custom_kubeconfig(file, &opts)
                .await
                .map_err(|e| Error::Config(e.to_string()))
        }
        None => match Config::from_kubeconfig(&opts).await {
            // In a Pod without a kubeconfig (the chart's console), its
            // ServiceAccount, as kubectl does.
            Err(e)
                if g.context.is_none() && std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() =>
            {
                Config::incluster().map_err(|ie| Error::Config(format!("{e}; in-cluster: {ie}")))
            }
            other => other.map_err(|e| Error::Config(e.to_string())),
        },
    }?;
    if let Some(user) = &g.as_user {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !g.as_group.is_empty() {
        config.auth_info.impersonate_groups = Some(g.as_group.clone());
    }
    let namespace = g
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    Ok((config, namespace))
}

/// Who the API server says the user is.
pub async fn whoami(client: &Client) -> Result<Identity, Error> {
    let review = Api::<SelfSubjectReview>::all(client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .map_err(api("asking the API server who you are (SelfSubjectReview)"))?;
    let info = review.status.and_then(|s| s.user_info).unwrap_or_default();
    Ok(Identity {
        user: info.username.unwrap_or_default(),
        groups: info.groups.unwrap_or_default(),
    })
}

pub(crate) async fn run_and_approvals(
    client: &Client,
    ns: &str,
    run: &str,
) -> Result<(AgentRun, Vec<Approval>), Error> {
    let r = Api::<AgentRun>::namespaced(client.clone(), ns)
        .get_opt(run)
        .await
        .map_err(api(format!("reading AgentRun {run}")))?
        .ok_or_else(|| {
            Error::Refused(format!(
                "AgentRun {run} not found in namespace {ns}; list them with kubectl agentrun list"
            ))
        })?;
    let uid = r.metadata.uid.clone().unwrap_or_default();
    let approvals = Api::<Approval>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api("listing Approvals"))?
        .items
        .into_iter()
        .filter(|a| a.spec.run_uid == uid)
        .collect();
    Ok((r, approvals))
}

pub(crate) async fn events_of(client: &Client, ns: &str, run: &str) -> Result<Vec<Event>, Error> {
    let mut events: Vec<Event> = Api::<Event>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api("listing Events"))?
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("AgentRun") && r.name.as_deref() == Some(run)
            })
        })
        .collect();
    events.sort_by_key(|e| {
        e.event_time
            .as_ref()
            .map(|t| t.0)
            .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| t.0))
    });
    Ok(events)
}

/// The Signals of run `run`, for the views; none where they cannot be read
/// (the views then say what the run's status says).
pub async fn signals_of(client: &Client, ns: &str, run: &AgentRun) -> Vec<Signal> {
    let selector = format!("{}={}", labels::RUN, run.name_any());
    let uid = run.metadata.uid.clone().unwrap_or_default();
    Api::<Signal>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.spec.run_uid == uid)
        .collect()
}

/// The journal chunks of run `run`'s steps (`StepJournal`, by the run's
/// label and UID), for the views; none where the API server serves no
/// StepJournals (an operator from before journals). A refusal is the
/// caller's to show: a missing journal hides a call that may have acted.
pub async fn journals_of(
    client: &Client,
    ns: &str,
    run: &AgentRun,
) -> Result<Vec<StepJournal>, Error> {
    let selector = format!("{}={}", labels::RUN, run.name_any());
    let uid = run.metadata.uid.clone().unwrap_or_default();
    match Api::<StepJournal>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector))
        .await
    {
        Ok(l) => Ok(l
            .items
            .into_iter()
            .filter(|j| j.spec.run_uid == uid)
            .collect()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Vec::new()),
        Err(e) => Err(api(format!(
            "listing the StepJournals of run {}",
            run.name_any()
        ))(e)),
    }
}
