//! What an authenticating proxy in front of the console says about who is
//! asking (`--auth proxy`): believed only from `--trusted-proxy` peers, and
//! only when it names one user and one list of groups.
//!
//! ```text
//!   peer in --trusted-proxy ─┬─ X-Forwarded-User: alice (once)        ─▶ Identity { alice, groups }
//!                            ├─ X-Forwarded-Groups: dev,ops (at most once)
//!                            └─ repeated, empty, not text, system:…  ─▶ 401
//! ```

use std::net::IpAddr;

use axum::http::{HeaderMap, HeaderName};
use ipnet::IpNet;

use crate::identity::Identity;

/// Whom the console trusts to name the user, and in which headers.
#[derive(Clone, Debug)]
pub struct ProxyTrust {
    /// Peers whose headers are believed; from anyone else they are refused.
    pub from: Vec<IpNet>,
    pub user_header: HeaderName,
    pub group_header: HeaderName,
    /// Put before the names the proxy gives, as the API server's own OIDC
    /// flags do (`--oidc-username-prefix`), so they match RBAC's subjects.
    pub user_prefix: String,
    pub group_prefix: String,
}

/// Whether `peer` is one of the trusted proxies (an IPv4 peer seen on an
/// IPv6 socket counts as its IPv4 address).
pub fn trusted(peer: IpAddr, from: &[IpNet]) -> bool {
    let peer = peer.to_canonical();
    from.iter().any(|net| net.contains(&peer))
}

/// The user and groups a trusted proxy named, prefixed: `None` without the
/// user header; an error when either header is repeated (a proxy that
/// appends its header to one the browser sent must not make two users one,
/// nor add the browser's groups to the user's), when the user header is
/// empty or either is not text, or when they name a `system:` user or group
/// (Kubernetes' own identities, such as `system:masters`, are never a person
/// signed in through a proxy). Groups come comma-separated, in one header.
pub fn proxied(headers: &HeaderMap, trust: &ProxyTrust) -> Result<Option<Identity>, &'static str> {
    let mut users = headers.get_all(&trust.user_header).iter();
    let Some(user) = users.next() else {
        return Ok(None);
    };
    if users.next().is_some() {
        return Err("the proxy's user header is repeated");
    }
    let user = user
        .to_str()
        .map_err(|_| "the proxy's user header is not text")?
        .trim();
    if user.is_empty() {
        return Err("the proxy's user header is empty");
    }
    if user.starts_with("system:") {
        return Err("the proxy named a system: user");
    }
    let mut listed = headers.get_all(&trust.group_header).iter();
    let list = listed.next();
    if listed.next().is_some() {
        return Err("the proxy's group header is repeated");
    }
    let mut groups = Vec::new();
    if let Some(v) = list {
        let v = v
            .to_str()
            .map_err(|_| "the proxy's group header is not text")?;
        for g in v.split(',').map(str::trim).filter(|g| !g.is_empty()) {
            if g.starts_with("system:") {
                return Err("the proxy named a system: group");
            }
            groups.push(format!("{}{g}", trust.group_prefix));
        }
    }
    Ok(Some(Identity {
        user: format!("{}{user}", trust.user_prefix),
        groups,
    }))
}
#[cfg(test)]
pub(crate) mod tests {
    use axum::http::{HeaderName, HeaderValue};

    use super::*;

    /// A request's headers, repeated names kept (the auth tests use it too).
    pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn trust() -> ProxyTrust {
        ProxyTrust {
            from: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            user_header: HeaderName::from_static("x-forwarded-user"),
            group_header: HeaderName::from_static("x-forwarded-groups"),
            user_prefix: String::new(),
            group_prefix: String::new(),
        }
    }
    #[test]
    fn only_peers_in_the_trusted_ranges_are_proxies() {
        let from = trust().from;
        for (peer, want) in [
            ("10.1.2.3", true),
            ("11.0.0.1", false),
            ("127.0.0.1", false),
            ("::ffff:10.9.9.9", true),
            ("::ffff:192.168.0.1", false),
            ("fd12::1", true),
            ("fe80::1", false),
        ] {
            assert_eq!(trusted(peer.parse().unwrap(), &from), want, "{peer}");
        }
        let one: Vec<IpNet> = vec!["127.0.0.1/32".parse().unwrap()];
        assert!(trusted("127.0.0.1".parse().unwrap(), &one));
        assert!(!trusted("127.0.0.3".parse().unwrap(), &one));
    }

    #[test]
    fn the_proxys_headers_name_one_user_and_their_groups() {
        let t = trust();
        let id = |user: &str, groups: &[&str]| Identity {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
        };
        let ok = [
            (headers(&[]), None),
            (
                headers(&[("x-forwarded-user", "alice")]),
                Some(id("alice", &[])),
            ),
            (
                headers(&[
                    ("X-Forwarded-User", " alice@example.com "),
                    ("x-forwarded-groups", "dev, ops,,oncall"),
                ]),
                Some(id("alice@example.com", &["dev", "ops", "oncall"])),
            ),
            (
                headers(&[("x-forwarded-user", "alice"), ("x-forwarded-groups", "")]),
                Some(id("alice", &[])),
            ),
            (headers(&[("x-forwarded-groups", "dev")]), None),
        ];
        for (h, want) in ok {
            assert_eq!(proxied(&h, &t), Ok(want), "{h:?}");
        }
        for (h, why) in [
            (
                headers(&[("x-forwarded-user", "alice"), ("x-forwarded-user", "bob")]),
                "the proxy's user header is repeated",
            ),
            (
                headers(&[
                    ("x-forwarded-user", "alice"),
                    ("x-forwarded-groups", "dev"),
                    ("x-forwarded-groups", "admins"),
                ]),
                "the proxy's group header is repeated",
            ),
            (
                // Repeated, even when one of them is empty.
                headers(&[
                    ("x-forwarded-user", "alice"),
                    ("X-Forwarded-Groups", ""),
                    ("x-forwarded-groups", "admins"),
                ]),
                "the proxy's group header is repeated",
            ),
            (
                headers(&[("x-forwarded-user", "  ")]),
                "the proxy's user header is empty",
            ),
            (
                headers(&[("x-forwarded-user", "system:admin")]),
                "the proxy named a system: user",
            ),
            (
                headers(&[
                    ("x-forwarded-user", "alice"),
                    ("x-forwarded-groups", "dev,system:masters"),
                ]),
                "the proxy named a system: group",
            ),
        ] {
            assert_eq!(proxied(&h, &t), Err(why), "{h:?}");
        }
        let prefixed = ProxyTrust {
            user_prefix: "oidc:".into(),
            group_prefix: "oidc:".into(),
            ..trust()
        };
        assert_eq!(
            proxied(
                &headers(&[("x-forwarded-user", "alice"), ("x-forwarded-groups", "dev")]),
                &prefixed
            ),
            Ok(Some(id("oidc:alice", &["oidc:dev"])))
        );
        let mut bad = HeaderMap::new();
        bad.insert(
            "x-forwarded-user",
            HeaderValue::from_bytes(b"al\xffice").unwrap(),
        );
        assert!(proxied(&bad, &t).is_err());
    }
}
