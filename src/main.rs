//! The operator binary: `run`, `crd`, `version`. Wiring only; the behaviour
//! lives in the library.
#![forbid(unsafe_code)]

use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use kube::runtime::events::Reporter;
use kube_lease_manager::LeaseManagerBuilder;
use tracing::{info, warn};

use agentrun_operator::controller::{self, Scope};
use agentrun_operator::metrics::{Health, Metrics, serve_health, serve_metrics};
use agentrun_operator::telemetry;

/// `--features dhat-heap`: every allocation is counted by call stack; the
/// profile is written to `$AGENTRUN_DHAT_FILE` (default `dhat-heap.json`)
/// when `run` exits cleanly (SIGTERM), with the live heap at its peak.
#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[derive(Parser)]
#[command(
    name = "agentrun-operator",
    version,
    about = "Durable AI-agent runs on Kubernetes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the operator.
    Run(Box<RunArgs>),
    /// Print the AgentRun and Approval CRDs as YAML.
    Crd,
    /// Print the version.
    Version,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Parser, Debug)]
struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "AGENTRUN_WATCH_NAMESPACE")]
    namespace: Option<String>,

    /// Publish an Event for every step start and success. With `false`, Events
    /// are kept for what calls for attention (retries, disruptions, approvals,
    /// re-plans, the run's end) and a step costs two API writes fewer; status
    /// and the step Pods still record every start and success.
    #[arg(long, env = "AGENTRUN_STEP_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    step_events: bool,

    /// Take a coordination.k8s.io Lease before acting, so only one replica acts.
    #[arg(long, env = "AGENTRUN_LEADER_ELECT", default_value_t = false)]
    leader_elect: bool,

    /// Name of the leader-election Lease.
    #[arg(long, env = "AGENTRUN_LEASE_NAME", default_value = "agentrun-operator")]
    lease_name: String,

    /// Namespace of the leader-election Lease (default: the Pod's namespace, else `default`).
    #[arg(long, env = "AGENTRUN_LEASE_NAMESPACE")]
    lease_namespace: Option<String>,

    /// This instance's identity in the Lease; an instance restarted with the
    /// same identity takes its Lease back at once (default: the Pod name / hostname).
    #[arg(long, env = "AGENTRUN_IDENTITY")]
    identity: Option<String>,

    /// Seconds a Lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    lease_duration_seconds: u64,

    /// Seconds one reconcile may take once it has its slot; past that it is
    /// abandoned (as a crash would leave it) and the run is tried again. The
    /// Kubernetes client has no read timeout, so this is what frees a slot
    /// held by a request the API server never answers.
    #[arg(long, env = "AGENTRUN_RECONCILE_TIMEOUT_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    reconcile_timeout_seconds: u64,

    /// The ClusterRole a journaled step's ServiceAccount is bound to in its
    /// run's namespace, so its Pod may write its own journal (the chart's
    /// `<roles.prefix>-journal-writer`; docs/journal.md).
    #[arg(long, env = "AGENTRUN_JOURNAL_WRITER_ROLE", default_value = agentrun_operator::controller::DEFAULT_JOURNAL_WRITER_ROLE)]
    journal_writer_role: String,

    /// Most runs active at once in one namespace; the rest wait in phase
    /// `Queued`, in creation order, and start as places free. 0: no cap.
    #[arg(
        long,
        env = "AGENTRUN_MAX_ACTIVE_RUNS_PER_NAMESPACE",
        default_value_t = 0
    )]
    max_active_runs_per_namespace: u32,

    /// Most runs active at once in all the namespaces watched; the rest
    /// queue, and a freed place goes to the namespace with the fewest
    /// active runs. 0: no cap.
    #[arg(long, env = "AGENTRUN_MAX_ACTIVE_RUNS", default_value_t = 0)]
    max_active_runs: u32,

    /// PriorityClass names whose runs queue first, the first listed first
    /// (a run's `podTemplate.priorityClassName`); runs of other classes, or
    /// none, queue after them. Within a class: creation order.
    #[arg(
        long,
        env = "AGENTRUN_QUEUE_PRIORITY_CLASSES",
        value_delimiter = ',',
        num_args = 0..
    )]
    queue_priority_classes: Vec<String>,

    /// Where finished runs are recorded (D18): `api` keeps a RunRecord per
    /// run through the API server; `postgres` a row per run in a PostgreSQL
    /// table (--history-database-url); `off` keeps no history (runs are
    /// neither recorded nor recognised when created again).
    #[arg(
        long,
        env = "AGENTRUN_HISTORY_STORE",
        value_enum,
        default_value = "api"
    )]
    history_store: HistoryStore,

    /// The PostgreSQL database of `--history-store postgres`, as a
    /// `postgres://user:password@host:port/dbname?sslmode=…` URL (or
    /// `key=value` pairs). TLS is required (`sslmode=require`, the default),
    /// verifying the server; `sslmode=disable` connects in the clear (a local
    /// Unix socket), `prefer` falls back to it when the server has no TLS.
    /// Best set from a Secret through the environment.
    #[arg(
        long,
        env = "AGENTRUN_HISTORY_DATABASE_URL",
        hide_env_values = true,
        required_if_eq("history_store", "postgres")
    )]
    history_database_url: Option<DatabaseUrl>,

    /// PEM certificates: the only roots trusted for the database's TLS (a
    /// private CA). Unset: the system's roots.
    #[arg(long, env = "AGENTRUN_HISTORY_DATABASE_CA_FILE")]
    history_database_ca_file: Option<std::path::PathBuf>,

    /// How long a finished run's record is kept (and a run created again
    /// with its name and spec runs nothing), e.g. `720h`.
    #[arg(long, env = "AGENTRUN_HISTORY_RETENTION", default_value = "720h", value_parser = parse_retention)]
    history_retention: jiff::SignedDuration,

    /// Most records one namespace is expected to hold inside the retention.
    /// More are reported (a warning each pruning, the gauge
    /// `agentrun_history_records_over_cap`) and kept: a record inside its
    /// retention is never removed for the count.
    #[arg(long, env = "AGENTRUN_HISTORY_MAX_PER_NAMESPACE", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    history_max_per_namespace: u32,

    /// Seconds between two prunings of the records past their retention.
    #[arg(long, env = "AGENTRUN_HISTORY_PRUNE_SECONDS", default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    history_prune_seconds: u64,

    /// Log format.
    #[arg(long, env = "AGENTRUN_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,

    /// Address of the Prometheus endpoint `/metrics`.
    #[arg(long, env = "AGENTRUN_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: std::net::SocketAddr,

    /// The Secret holding the approval notification channels (key
    /// `channels.yaml`), as NAMESPACE/NAME. Unset: no notifications.
    #[arg(long, env = "AGENTRUN_NOTIFY_SECRET", value_parser = parse_notify_secret)]
    notify_secret: Option<(String, String)>,

    /// An address range notifications may be sent to although it is
    /// internal (loopback, link-local, private, the Service CIDR), e.g. a
    /// receiver inside the cluster. Repeatable; comma-separated in the env.
    #[arg(long, env = "AGENTRUN_NOTIFY_ALLOW_CIDR", value_delimiter = ',')]
    notify_allow_cidr: Vec<ipnet::IpNet>,

    /// The console's base URL; notifications link to the run there.
    #[arg(long, env = "AGENTRUN_CONSOLE_URL")]
    console_url: Option<String>,

    /// Address of `/healthz` and `/readyz`.
    #[arg(long, env = "AGENTRUN_HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    health_addr: std::net::SocketAddr,
}

/// Logs (text or JSON; inside a reconcile each line carries the run's
/// `trace_id` and the reconcile's `span_id`) and, when `OTEL_*` asks for
/// them, trace spans over OTLP. Returns the provider to flush on exit.
fn init_tracing(
    format: LogFormat,
) -> Result<Option<opentelemetry_sdk::trace::SdkTracerProvider>, String> {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_lease_manager=warn"));
    let fmt = match format {
        // Colours only on a terminal: `kubectl logs` and log collectors get
        // plain text.
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().boxed(),
    };
    let provider = telemetry::trace::init().map_err(|e| format!("OTLP trace exporter: {e}"))?;
    // Only the run's own spans go to OpenTelemetry (target agentrun::trace);
    // the rest of the tracing spans stay in the logs.
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("agentrun-operator"))
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target() == telemetry::trace::TARGET
            }))
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .init();
    Ok(provider)
}

fn parse_notify_secret(s: &str) -> Result<(String, String), String> {
    agentrun_operator::notify::parse_secret_ref(s)
}

/// The Lease's namespace: `--lease-namespace`, else the Pod's, else `default`.
fn lease_namespace(args: &RunArgs) -> String {
    args.lease_namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_else(|| "default".into())
}

fn default_identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("agentrun-operator-{}", std::process::id()))
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[derive(Debug, thiserror::Error)]
enum RunError {
    #[error("connecting to the Kubernetes API: {0}")]
    Client(#[source] kube::Error),
    #[error("leader election: {0}")]
    Lease(#[source] kube_lease_manager::LeaseManagerError),
    #[error("lost the leader lease; exiting so that a fresh instance takes over")]
    LostLease,
    #[error("the run history: {0}")]
    History(String),
    #[error("serving {what} on {addr}: {source}")]
    Serve {
        what: &'static str,
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

async fn run(args: RunArgs) -> Result<(), RunError> {
    // Every API response's `Date` feeds the controller's clock, which never
    // runs ahead of the API server's (src/controller/clock.rs).
    let clock = agentrun_operator::controller::clock::Clock::from_env();
    let config = kube::Config::infer()
        .await
        .map_err(|e| RunError::Client(kube::Error::InferConfig(e)))?;
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(RunError::Client)?
        .with_layer(&clock.layer())
        .build();
    // A history that cannot be reached stops the start: an operator that
    // records nothing would let every re-sync run again.
    let history = history_settings(&args, &client).await?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry);
    let health = Health::default();
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(|source| RunError::Serve {
            what: "metrics",
            addr: args.metrics_addr,
            source,
        })?;
    let health_listener = tokio::net::TcpListener::bind(args.health_addr)
        .await
        .map_err(|source| RunError::Serve {
            what: "health",
            addr: args.health_addr,
            source,
        })?;
    tokio::spawn(serve_metrics(metrics_listener, registry, metrics.clone()));
    tokio::spawn(serve_health(health_listener, health.clone()));
    info!(metrics = %args.metrics_addr, health = %args.health_addr, "serving metrics and health");
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    let scope = Scope {
        namespace: args.namespace.clone(),
        step_events: args.step_events,
        notify: args
            .notify_secret
            .clone()
            .map(|(ns, name)| agentrun_operator::notify::Settings {
                secret_namespace: ns,
                secret_name: name,
                allow: args.notify_allow_cidr.clone(),
                console_url: args.console_url.clone(),
            }),
        reconcile_timeout: Duration::from_secs(args.reconcile_timeout_seconds),
        journal_writer_role: args.journal_writer_role.clone(),
        caps: agentrun_operator::controller::capacity::Caps {
            per_namespace: Some(args.max_active_runs_per_namespace).filter(|&n| n > 0),
            total: Some(args.max_active_runs).filter(|&n| n > 0),
            priority_classes: args
                .queue_priority_classes
                .iter()
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty())
                .collect(),
        },
        history,
        leader: args
            .leader_elect
            .then(|| agentrun_operator::controller::Leader {
                identity: identity.clone(),
                lease_name: args.lease_name.clone(),
                lease_namespace: lease_namespace(&args),
            }),
        clock,
    };
    let reporter = Reporter {
        controller: "agentrun-operator".into(),
        instance: Some(identity.clone()),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    tokio::spawn(async move {
        shutdown_signal().await;
        info!("shutdown requested");
        let _ = stop_tx.send(true);
    });

    if !args.leader_elect {
        metrics.leader.set(1);
        controller::run(client, scope, reporter, metrics, health, stopped).await;
        return Ok(());
    }
    // A standby is healthy and ready; it just does not act.
    health.set_ready(true);

    let lease_namespace = lease_namespace(&args);
    let manager = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&lease_namespace)
        .with_identity(&identity)
        .with_duration(args.lease_duration_seconds)
        .with_grace((args.lease_duration_seconds / 3).max(1))
        .build()
        .await
        .map_err(RunError::Lease)?;
    let grace = Duration::from_secs((args.lease_duration_seconds / 3).max(1));
    let (mut leader, lease_task) = agentrun_operator::lease::elect(manager, grace);
    info!(%identity, lease = %format!("{lease_namespace}/{}", args.lease_name), "waiting for the leader lease");

    let mut stop = stop_rx.clone();
    // Wait to lead (or to be told to stop).
    loop {
        if *leader.borrow_and_update() {
            break;
        }
        tokio::select! {
            changed = leader.changed() => {
                if changed.is_err() {
                    return Err(RunError::LostLease);
                }
            }
            _ = stop.wait_for(|s| *s) => return Ok(()),
        }
    }
    info!(%identity, "acquired the leader lease");
    metrics.leader.set(1);
    health.set_ready(false);

    let lost = async move {
        loop {
            if leader.changed().await.is_err() || !*leader.borrow_and_update() {
                return;
            }
        }
    };
    let lost_lease = tokio::select! {
        _ = controller::run(client, scope, reporter, metrics.clone(), health, stopped) => false,
        _ = lost => true,
    };
    // Both futures are dropped here; with the receiver gone the lease task
    // releases the Lease, so a standby takes over without waiting for expiry.
    metrics.leader.set(0);
    if lost_lease {
        warn!("lost the leader lease");
        return Err(RunError::LostLease);
    }
    info!("releasing the leader lease");
    let _ = tokio::time::timeout(Duration::from_secs(5), lease_task).await;
    Ok(())
}

/// Where finished runs are recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum HistoryStore {
    /// RunRecord objects through the API server.
    Api,
    /// Rows of a PostgreSQL table.
    Postgres,
    /// No history.
    Off,
}

fn parse_retention(s: &str) -> Result<jiff::SignedDuration, String> {
    let d = agentrun_operator::api::Duration::from(s)
        .parse()
        .map_err(|e| e.to_string())?;
    if d <= jiff::SignedDuration::ZERO {
        return Err("the retention must be longer than 0s".into());
    }
    Ok(d)
}

/// A database URL: it holds a password, so it is never printed.
#[derive(Clone)]
struct DatabaseUrl(String);

impl std::str::FromStr for DatabaseUrl {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(DatabaseUrl(s.to_owned()))
    }
}

impl std::fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatabaseUrl(***)")
    }
}

async fn history_settings(
    args: &RunArgs,
    client: &kube::Client,
) -> Result<Option<agentrun_operator::history::Settings>, RunError> {
    use agentrun_operator::history::{ApiStore, PgStore, Retention, Settings, Store};
    let store = match args.history_store {
        HistoryStore::Off => return Ok(None),
        HistoryStore::Api => Store::Api(ApiStore::new(client.clone(), args.namespace.clone())),
        HistoryStore::Postgres => {
            let Some(DatabaseUrl(url)) = &args.history_database_url else {
                return Err(RunError::History(
                    "--history-store postgres needs --history-database-url (or AGENTRUN_HISTORY_DATABASE_URL)".into(),
                ));
            };
            let ca =
                match &args.history_database_ca_file {
                    Some(path) => Some(std::fs::read(path).map_err(|e| {
                        RunError::History(format!("reading {}: {e}", path.display()))
                    })?),
                    None => None,
                };
            let store = PgStore::connect(url, ca.as_deref(), args.namespace.clone())
                .await
                .map_err(|e| RunError::History(e.to_string()))?;
            info!(store = ?store, "recording finished runs in PostgreSQL");
            Store::Postgres(Box::new(store))
        }
    };
    Ok(Some(Settings {
        store: std::sync::Arc::new(store),
        retention: Retention {
            max_age: args.history_retention,
            max_per_namespace: args.history_max_per_namespace as usize,
        },
        prune_every: Duration::from_secs(args.history_prune_seconds),
    }))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            // Written, not printed: `print!` panics when the reader has gone
            // (`agentrun-operator crd | head`); a closed pipe is a normal end.
            use std::io::Write;
            match std::io::stdout().write_all(agentrun_operator::api::crds_yaml().as_bytes()) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    eprintln!("agentrun-operator: writing the CRDs: {e}");
                    std::process::ExitCode::FAILURE
                }
                _ => std::process::ExitCode::SUCCESS,
            }
        }
        Command::Version => {
            println!("agentrun-operator {}", env!("CARGO_PKG_VERSION"));
            std::process::ExitCode::SUCCESS
        }
        Command::Run(args) => {
            #[cfg(feature = "dhat-heap")]
            let _profiler = dhat::Profiler::builder()
                .file_name(
                    std::env::var_os("AGENTRUN_DHAT_FILE")
                        .unwrap_or_else(|| "dhat-heap.json".into()),
                )
                // Deep enough to reach the operator's frames through serde and kube.
                .trim_backtraces(Some(40))
                .build();
            // One TLS crypto provider for every rustls client in the process
            // (kube's, the OTLP exporter's, the notifier's): ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let provider = match init_tracing(args.log_format) {
                Ok(provider) => provider,
                Err(err) => {
                    eprintln!("agentrun-operator: {err}");
                    return std::process::ExitCode::FAILURE;
                }
            };
            if provider.is_some() {
                info!("exporting traces over OTLP");
            }
            let code = match run(*args).await {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(err) => {
                    tracing::error!(error = %err, "operator stopped");
                    std::process::ExitCode::FAILURE
                }
            };
            if let Some(provider) = provider {
                // Export what is batched; a SIGKILL loses at most one batch
                // (OTEL_BSP_SCHEDULE_DELAY), never a span's identity.
                let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            }
            code
        }
    }
}
