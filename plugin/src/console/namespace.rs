//! The namespace a signed-in user sees when they may not list every one:
//! their choice (a cookie), else a ServiceAccount's own namespace. Only a
//! preference: the API server still decides what they may list there.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Where the console looks: one namespace, or all the user may list.
#[derive(Clone, Debug)]
pub enum Scope {
    Namespace(String),
    All,
}

/// A ServiceAccount's namespace, from its user name.
pub fn own_namespace(user: &str) -> Option<String> {
    let (ns, _) = user
        .strip_prefix("system:serviceaccount:")?
        .split_once(':')?;
    Some(ns.to_owned()).filter(|ns| namespace_name(ns))
}

/// The namespace a signed-in user chose to see.
pub const NAMESPACE_COOKIE: &str = "agentrun_namespace";

/// A namespace's name: a DNS label (RFC 1123).
pub fn namespace_name(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[derive(serde::Deserialize)]
pub struct Choice {
    #[serde(default)]
    name: String,
}

/// `GET /namespace?name=NS`: the namespace a user who may not list every
/// one sees (a preference in a cookie; the API server still decides what
/// they may list there).
pub async fn choose_namespace(axum::extract::Query(c): axum::extract::Query<Choice>) -> Response {
    if !namespace_name(&c.name) {
        return (
            StatusCode::BAD_REQUEST,
            format!("{:?} is not a namespace name", c.name),
        )
            .into_response();
    }
    let set = format!(
        "{NAMESPACE_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
        c.name
    );
    (
        StatusCode::SEE_OTHER,
        [
            (axum::http::header::LOCATION, "/".to_owned()),
            (axum::http::header::SET_COOKIE, set),
        ],
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_a_dns_label_and_a_service_account_has_one() {
        for (s, ok) in [
            ("team-a", true),
            ("a", true),
            ("Team", false),
            ("-a", false),
            ("a-", false),
            ("a.b", false),
            ("", false),
            (&"a".repeat(64), false),
            ("a;b=c", false),
        ] {
            assert_eq!(namespace_name(s), ok, "{s:?}");
        }
        assert_eq!(
            own_namespace("system:serviceaccount:team-a:reader").as_deref(),
            Some("team-a")
        );
        assert_eq!(own_namespace("alice"), None);
        assert_eq!(own_namespace("system:serviceaccount:broken"), None);
    }
}
