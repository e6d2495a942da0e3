//! `kubectl agentrun console`'s flags, and the console's options they make.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::console::auth::Mode;
use crate::console::state::Options;

#[derive(clap::Args, Debug)]
pub struct ConsoleArgs {
    /// The port; by default any free one (the URL printed carries a
    /// token for this session).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Open it in the default browser: through a page only you can read
    /// (the token is never a process argument), removed once used.
    #[arg(long)]
    pub open: bool,
    /// A view without decisions: no forms, no writes.
    #[arg(long)]
    pub read_only: bool,
    /// Listen on this address instead of 127.0.0.1; beyond loopback only
    /// with --auth (each person signs in and is served as themselves).
    #[arg(long)]
    pub listen: Option<IpAddr>,
    /// How people sign in (in the cluster): `proxy` (an authenticating
    /// proxy names them; the console impersonates them), `token` (they
    /// paste a bearer token), or both. Without it: the kubeconfig's
    /// user, for whoever has the printed URL, on loopback only.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub auth: Vec<Mode>,
    /// With --auth proxy: the proxy's addresses (CIDR, repeatable); the
    /// user headers of any other peer are refused.
    #[arg(long = "trusted-proxy", value_name = "CIDR")]
    pub trusted_proxy: Vec<ipnet::IpNet>,
    /// With --auth proxy: the header that names the user.
    #[arg(long, default_value = "X-Forwarded-User")]
    pub user_header: String,
    /// With --auth proxy: the header that lists the user's groups
    /// (comma-separated, in one header; a repeated one is refused).
    #[arg(long, default_value = "X-Forwarded-Groups")]
    pub group_header: String,
    /// With --auth proxy: put before the user's name (as the API
    /// server's --oidc-username-prefix does), e.g. `oidc:`.
    #[arg(long, default_value = "")]
    pub user_prefix: String,
    /// With --auth proxy: put before each group's name.
    #[arg(long, default_value = "")]
    pub group_prefix: String,
    /// With --auth token: how long a sign-in lasts (e.g. 8h, 30m).
    #[arg(long, default_value = "8h", value_parser = parse_ttl)]
    pub session_ttl: std::time::Duration,
}

impl ConsoleArgs {
    /// The console's options; `namespace` is the global `-n`.
    pub fn options(self, namespace: Option<String>) -> Options {
        Options {
            namespace,
            address: SocketAddr::new(self.listen.unwrap_or(Ipv4Addr::LOCALHOST.into()), self.port),
            open: self.open,
            read_only: self.read_only,
            auth: self.auth,
            trusted_proxies: self.trusted_proxy,
            user_header: self.user_header,
            group_header: self.group_header,
            user_prefix: self.user_prefix,
            group_prefix: self.group_prefix,
            session_ttl: self.session_ttl,
        }
    }
}

/// `8h`, `30m`, `90s`: a session's lifetime.
fn parse_ttl(s: &str) -> Result<std::time::Duration, String> {
    let d: jiff::SignedDuration = s
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 8h, 30m)"))?;
    std::time::Duration::try_from(d)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s:?}: a session lasts a while"))
}
