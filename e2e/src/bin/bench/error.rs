//! Why the benchmark stopped, and the two adapters that name what failed.

use std::path::PathBuf;

/// Why the benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A file, a child process or the network.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The API server refused a request or did not answer.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The kubeconfig cannot be read or used.
    #[error("{what}: {message}")]
    Config { what: String, message: String },
    /// A binary the benchmark starts is not built.
    #[error("{} not found: build it with `cargo build --release -p agentrun-operator -p agentrun-e2e --bins`", .0.display())]
    NotBuilt(PathBuf),
    /// A stage did not reach its end in time, or ended wrongly: what was
    /// awaited and where the logs are.
    #[error("{0}")]
    Stage(String),
}

pub type Res<T> = Result<T, BenchError>;

pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io {
        what: what.into(),
        source,
    }
}

pub fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> BenchError {
    move |source| BenchError::Api {
        what: what.into(),
        source,
    }
}
