//! What a notification says, in each format. The JSON document is the
//! contract (docs/notifications.md, with its JSON Schema); the Slack and
//! Teams layouts render the same facts for people. A body depends only on
//! the approval and the event, so every retry of a delivery sends the same
//! bytes.

use jiff::Timestamp;
use serde_json::{Value, json};

use super::channels::Format;
use crate::api::{Approval, ApprovalKind, NotificationEvent};

/// Everything a message is made from.
pub struct Facts<'a> {
    pub approval: &'a Approval,
    pub event: NotificationEvent,
    pub delivery_id: &'a str,
    /// When the event happened (asked, reminder due, decided, expired).
    pub occurred_at: Timestamp,
    /// `--console-url`, when set.
    pub console_url: Option<&'a str>,
}

/// The body and its content type.
pub fn render(format: Format, f: &Facts) -> (Vec<u8>, &'static str) {
    let doc = document(f);
    let value = match format {
        Format::Json => doc,
        Format::Slack => slack(f, &doc),
        Format::Msteams => teams(f, &doc),
    };
    (
        serde_json::to_vec(&value).expect("a JSON value always serializes"),
        "application/json",
    )
}

/// Who may decide, in words.
pub fn who_may_decide(a: &Approval) -> String {
    let ns = a.metadata.namespace.as_deref().unwrap_or_default();
    let mut who = match &a.spec.approvers {
        Some(ap) => ap.describe(),
        None => format!("anyone allowed to update approvals in namespace {ns}"),
    };
    if a.spec.quorum > 1 {
        who.push_str(&format!(" ({} distinct approvers needed)", a.spec.quorum));
    }
    if a.spec.separate_from_requester
        && let Some(r) = &a.spec.requested_by
    {
        who.push_str(&format!("; not {r}, who created the run"));
    }
    who
}

/// The exact commands that answer the approval.
pub fn commands(a: &Approval) -> Value {
    let ns = a.metadata.namespace.as_deref().unwrap_or_default();
    let (run, step) = (&a.spec.run_name, &a.spec.step);
    match a.spec.kind {
        ApprovalKind::Approve => json!({
            "approve": format!("kubectl agentrun approve {run} {step} -n {ns}"),
            "reject": format!("kubectl agentrun reject {run} {step} -n {ns} --comment '<why>'"),
        }),
        ApprovalKind::Reconcile => json!({
            "retry": format!("kubectl agentrun reconcile {run} {step} -n {ns} --retry"),
            "markSucceeded": format!("kubectl agentrun reconcile {run} {step} -n {ns} --succeeded"),
            "markFailed": format!("kubectl agentrun reconcile {run} {step} -n {ns} --failed"),
        }),
    }
}

fn console_link(f: &Facts) -> Option<String> {
    let a = f.approval;
    f.console_url.map(|base| {
        format!(
            "{}/ns/{}/runs/{}",
            base.trim_end_matches('/'),
            a.metadata.namespace.as_deref().unwrap_or_default(),
            a.spec.run_name
        )
    })
}

/// The JSON document (format `json`).
pub fn document(f: &Facts) -> Value {
    let a = f.approval;
    let status = a.status.clone().unwrap_or_default();
    let mut doc = json!({
        "apiVersion": "agentrun.dev/v1alpha1",
        "kind": "ApprovalNotification",
        "deliveryId": f.delivery_id,
        "event": f.event.as_str(),
        "occurredAt": f.occurred_at.to_string(),
        "namespace": a.metadata.namespace,
        "run": {"name": a.spec.run_name, "uid": a.spec.run_uid},
        "step": a.spec.step,
        "approval": {
            "name": a.metadata.name,
            "uid": a.metadata.uid,
            "kind": a.spec.kind,
            "question": a.spec.question,
            "phase": status.phase,
            "expiresAt": a.spec.expires_at.as_ref().map(|t| t.0.to_string()),
            "onTimeout": a.spec.on_timeout,
            "quorum": a.spec.quorum,
            "votes": status.votes,
            "decision": a.spec.decision,
            "decidedBy": status.decided_by,
            "decidedAt": status.decided_at.as_ref().map(|t| t.0.to_string()),
            "comment": a.spec.comment,
            "message": status.message,
        },
        "context": a.spec.context,
        "approvers": a.spec.approvers,
        "whoMayDecide": who_may_decide(a),
        "requestedBy": a.spec.requested_by,
        "commands": commands(a),
    });
    if let Some(link) = console_link(f) {
        doc["consoleUrl"] = json!(link);
    }
    doc
}

/// One line saying what happened.
fn headline(f: &Facts) -> String {
    let a = f.approval;
    let ns = a.metadata.namespace.as_deref().unwrap_or_default();
    let what = format!("run {}/{} step {}", ns, a.spec.run_name, a.spec.step);
    let status = a.status.clone().unwrap_or_default();
    match f.event {
        NotificationEvent::Requested => format!("Approval needed: {what}"),
        NotificationEvent::Escalated => format!("Still waiting for approval: {what}"),
        NotificationEvent::Decided => format!(
            "{:?} by {}: {what}",
            status.phase,
            status.decided_by.unwrap_or_else(|| "unknown".into())
        ),
        NotificationEvent::Expired => format!("Approval expired: {what}"),
    }
}

/// The facts as (label, value) pairs, in reading order.
fn fields(doc: &Value) -> Vec<(&'static str, String)> {
    let s = |v: &Value| match v {
        Value::Null => None,
        Value::String(s) if s.is_empty() => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    };
    let mut out = Vec::new();
    let mut push = |label, v: &Value| {
        if let Some(v) = s(v) {
            out.push((label, v));
        }
    };
    push("Question", &doc["approval"]["question"]);
    push("Why", &doc["context"]["reason"]);
    push("Idempotency key", &doc["context"]["idempotencyKey"]);
    push("Who may decide", &doc["whoMayDecide"]);
    push("Votes", &doc["approval"]["votes"]);
    push("Deadline", &doc["approval"]["expiresAt"]);
    push("Decision", &doc["approval"]["decision"]);
    push("Comment", &doc["approval"]["comment"]);
    push("Status", &doc["approval"]["message"]);
    out
}

fn command_lines(doc: &Value) -> Vec<String> {
    doc["commands"]
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn pending(f: &Facts) -> bool {
    matches!(
        f.event,
        NotificationEvent::Requested | NotificationEvent::Escalated
    )
}

/// Text for Slack's mrkdwn: `&`, `<` and `>` as the entities Slack asks
/// for, so no `<url|label>` link, `<@U…>`/`<!here>`/`<#C…>`/`<!subteam^…>`
/// mention or date token can be written by whoever wrote the text; and on
/// one line, so no value can start a line that looks like another field.
pub fn slack_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\r' | '\n' | '\u{2028}' | '\u{2029}' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A mrkdwn text object that Slack does not scan for bare links, channel
/// names or mentions (`verbatim`).
fn mrkdwn(text: String) -> Value {
    json!({"type": "mrkdwn", "text": text, "verbatim": true})
}

fn slack(f: &Facts, doc: &Value) -> Value {
    let title = headline(f);
    let mut text = fields(doc)
        .into_iter()
        .map(|(k, v)| format!("*{k}:* {}", slack_text(&v)))
        .collect::<Vec<_>>()
        .join("\n");
    if let Some(done) = doc["context"]["completedSteps"].as_array() {
        let done: Vec<String> = done
            .iter()
            .filter_map(|s| s.as_str())
            .map(|s| format!("• {}", slack_text(s)))
            .collect();
        if !done.is_empty() {
            text.push_str(&format!("\n*Done so far:*\n{}", done.join("\n")));
        }
    }
    let mut blocks = vec![
        // plain_text: shown as written, no markup at all.
        json!({"type": "header", "text": {"type": "plain_text", "text": truncate(&title, 150), "emoji": false}}),
        json!({"type": "section", "text": mrkdwn(truncate(&text, 3000))}),
    ];
    if pending(f) {
        let cmds = command_lines(doc)
            .into_iter()
            .map(|c| format!("`{}`", slack_text(&c).replace('`', "'")))
            .collect::<Vec<_>>()
            .join("\n");
        blocks.push(json!({"type": "section", "text": mrkdwn(cmds)}));
    }
    if let Some(link) = doc["consoleUrl"].as_str() {
        blocks.push(json!({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": "Open in the console"}, "url": link}
        ]}));
    }
    // The top-level text is the notification's fallback, read as mrkdwn.
    json!({"text": slack_text(&title), "blocks": blocks})
}

/// A run of text in an Adaptive Card: a `TextRun` takes no markdown, so
/// `[label](url)`, emphasis, lists and headings in it are shown as typed.
fn run(text: &str) -> Value {
    json!({"type": "TextRun", "text": text})
}

fn teams(f: &Facts, doc: &Value) -> Value {
    // Every text that carries what someone else wrote is a RichTextBlock of
    // TextRuns, never a TextBlock or FactSet (both render markdown).
    let mut heading = run(&headline(f));
    heading["weight"] = json!("Bolder");
    heading["size"] = json!("Medium");
    let mut body = vec![json!({"type": "RichTextBlock", "inlines": [heading]})];
    for (k, v) in fields(doc) {
        let mut label = run(&format!("{k}: "));
        label["weight"] = json!("Bolder");
        body.push(json!({"type": "RichTextBlock", "inlines": [label, run(&v)]}));
    }
    if pending(f) {
        for c in command_lines(doc) {
            let mut cmd = run(&c);
            cmd["fontType"] = json!("Monospace");
            body.push(json!({"type": "RichTextBlock", "inlines": [cmd]}));
        }
    }
    let mut card = json!({
        "type": "AdaptiveCard",
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "version": "1.4",
        "body": body,
    });
    if let Some(link) = doc["consoleUrl"].as_str() {
        card["actions"] =
            json!([{"type": "Action.OpenUrl", "title": "Open in the console", "url": link}]);
    }
    json!({
        "type": "message",
        "attachments": [{"contentType": "application/vnd.microsoft.card.adaptive", "content": card}],
    })
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max - 1).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;
    use crate::api::{
        ApprovalContext, ApprovalSpec, ApprovalStatus, Approvers, Decision, Effect, OnTimeout,
    };

    const SCHEMA: &str = include_str!("../../docs/notifications.schema.json");

    fn approval(kind: ApprovalKind) -> Approval {
        let t = Timestamp::from_second(1_750_000_000).unwrap();
        Approval {
            metadata: ObjectMeta {
                name: Some("refund-refund-a9aff4-r1-approve".into()),
                namespace: Some("payments".into()),
                uid: Some("5a1d".into()),
                creation_timestamp: Some(Time(t)),
                ..ObjectMeta::default()
            },
            spec: ApprovalSpec {
                run_name: "refund".into(),
                run_uid: "77ee".into(),
                step: "issue".into(),
                plan_revision: 1,
                kind,
                question: "Refund order 4711?".into(),
                context: Some(ApprovalContext {
                    reason: "step issue requires approval before it starts".into(),
                    effect: Some(Effect::NonIdempotent),
                    idempotency_key: Some("f7a2c694".into()),
                    pod: None,
                    completed_steps: vec!["lookup: {\"amount\": 23.9}".into()],
                    repeats: None,
                }),
                expires_at: Some(Time(
                    t.checked_add(jiff::SignedDuration::from_hours(24)).unwrap(),
                )),
                step_digest: None,
                on_timeout: OnTimeout::Reject,
                decision: None,
                comment: None,
                approvers: Some(Approvers {
                    users: vec!["alice".into()],
                    groups: vec!["payments-leads".into()],
                    service_accounts: vec![],
                }),
                quorum: 2,
                separate_from_requester: true,
                requested_by: Some("dave".into()),
                decided_by: None,
                decided_by_groups: vec![],
                votes: vec![],
                notify: vec!["team".into()],
                escalate: None,
            },
            status: Some(ApprovalStatus {
                votes: Some("0/2".into()),
                ..ApprovalStatus::default()
            }),
        }
    }

    fn facts(a: &Approval, event: NotificationEvent) -> Facts<'_> {
        Facts {
            approval: a,
            event,
            delivery_id: "5a1d.requested.team",
            occurred_at: Timestamp::from_second(1_750_000_000).unwrap(),
            console_url: Some("https://console.example/"),
        }
    }

    fn valid(doc: &Value) {
        let schema: Value = serde_json::from_str(SCHEMA).expect("the schema is JSON");
        let validator = jsonschema::validator_for(&schema).expect("the schema compiles");
        let errors: Vec<String> = validator
            .iter_errors(doc)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        assert!(errors.is_empty(), "{errors:#?}\n{doc:#}");
    }

    #[test]
    fn the_json_document_matches_its_published_schema() {
        let mut decided = approval(ApprovalKind::Approve);
        decided.spec.decision = Some(Decision::Rejected);
        decided.spec.comment = Some("fraud".into());
        decided.status = Some(ApprovalStatus {
            phase: crate::api::ApprovalPhase::Rejected,
            decided_at: Some(Time(Timestamp::from_second(1_750_000_100).unwrap())),
            decided_by: Some("alice".into()),
            ..ApprovalStatus::default()
        });
        let mut bare = approval(ApprovalKind::Reconcile);
        bare.spec.context = None;
        bare.spec.approvers = None;
        bare.spec.expires_at = None;
        bare.status = None;
        for (a, e) in [
            (
                approval(ApprovalKind::Approve),
                NotificationEvent::Requested,
            ),
            (decided, NotificationEvent::Decided),
            (bare, NotificationEvent::Escalated),
        ] {
            let f = facts(&a, e);
            valid(&document(&f));
            valid(&document(&Facts {
                console_url: None,
                ..f
            }));
        }
        // And the schema is not a rubber stamp.
        let mut wrong = document(&facts(
            &approval(ApprovalKind::Approve),
            NotificationEvent::Requested,
        ));
        wrong["event"] = json!("asked");
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        assert!(!jsonschema::is_valid(&schema, &wrong));
    }

    #[test]
    fn the_document_says_who_decides_how_and_where() {
        let a = approval(ApprovalKind::Approve);
        let doc = document(&facts(&a, NotificationEvent::Requested));
        assert_eq!(
            doc["whoMayDecide"],
            "user alice; group payments-leads (2 distinct approvers needed); not dave, who created the run"
        );
        assert_eq!(
            doc["commands"]["approve"],
            "kubectl agentrun approve refund issue -n payments"
        );
        assert_eq!(
            doc["consoleUrl"],
            "https://console.example/ns/payments/runs/refund"
        );
        let r = approval(ApprovalKind::Reconcile);
        let doc = document(&facts(&r, NotificationEvent::Requested));
        assert_eq!(
            doc["commands"]["retry"],
            "kubectl agentrun reconcile refund issue -n payments --retry"
        );
        assert!(doc["commands"].get("approve").is_none());
    }

    #[test]
    fn slack_and_teams_render_the_same_facts_readably() {
        let a = approval(ApprovalKind::Approve);
        let f = facts(&a, NotificationEvent::Requested);
        let (body, ct) = render(Format::Slack, &f);
        assert_eq!(ct, "application/json");
        let slack: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            slack["text"],
            "Approval needed: run payments/refund step issue"
        );
        let text = slack["blocks"][1]["text"]["text"].as_str().unwrap();
        assert!(text.contains("*Question:* Refund order 4711?"), "{text}");
        assert!(text.contains("*Idempotency key:* f7a2c694"), "{text}");
        assert!(text.contains("• lookup:"), "{text}");
        assert!(
            slack["blocks"][2]["text"]["text"]
                .as_str()
                .unwrap()
                .contains("`kubectl agentrun approve refund issue -n payments`")
        );
        assert_eq!(
            slack["blocks"][3]["elements"][0]["url"],
            "https://console.example/ns/payments/runs/refund"
        );
        let (body, _) = render(Format::Msteams, &f);
        let teams: Value = serde_json::from_slice(&body).unwrap();
        let card = &teams["attachments"][0]["content"];
        assert_eq!(card["type"], "AdaptiveCard");
        assert_eq!(card["body"][1]["inlines"][0]["text"], "Question: ");
        assert_eq!(card["body"][1]["inlines"][1]["text"], "Refund order 4711?");
        assert_eq!(card["actions"][0]["type"], "Action.OpenUrl");
        // The same facts give the same bytes: a retry sends what the first attempt sent.
        assert_eq!(render(Format::Json, &f).0, render(Format::Json, &f).0);
    }

    /// What a run's author wrote, made to look like markup.
    const HOSTILE: &str = "Refund <https://evil.example|the order> & ping <!channel> <@U0BOSS> <#C0OPS> <!subteam^S0|leads> <!date^1^{date}|x>\n*Decision:* Approved [click](https://evil.example) **now**";

    #[test]
    fn slack_text_escapes_links_mentions_and_lines() {
        // Known answers: the entities Slack documents, one line.
        assert_eq!(slack_text("a & b"), "a &amp; b");
        assert_eq!(slack_text("<@U123>"), "&lt;@U123&gt;");
        assert_eq!(
            slack_text("<http://x.example|y>"),
            "&lt;http://x.example|y&gt;"
        );
        assert_eq!(slack_text("&lt;"), "&amp;lt;");
        assert_eq!(slack_text("one\r\ntwo\u{2028}three"), "one  two three");
        assert_eq!(
            slack_text(HOSTILE),
            "Refund &lt;https://evil.example|the order&gt; &amp; ping &lt;!channel&gt; &lt;@U0BOSS&gt; &lt;#C0OPS&gt; &lt;!subteam^S0|leads&gt; &lt;!date^1^{date}|x&gt; *Decision:* Approved [click](https://evil.example) **now**"
        );
    }

    #[test]
    fn a_hostile_question_is_text_in_slack_and_in_teams() {
        let mut a = approval(ApprovalKind::Approve);
        a.spec.question = HOSTILE.into();
        a.spec.context.as_mut().unwrap().completed_steps =
            vec!["lookup: <!here>\n*Decision:* Approved".into()];
        let f = facts(&a, NotificationEvent::Requested);
        let slack: Value = serde_json::from_slice(&render(Format::Slack, &f).0).unwrap();
        let text = slack["blocks"][1]["text"].clone();
        assert_eq!(text["verbatim"], true);
        let text = text["text"].as_str().unwrap();
        // No raw `<` anywhere in mrkdwn: no link or mention can form.
        assert!(!text.contains('<') && !text.contains('>'), "{text}");
        assert!(
            text.contains(&format!("*Question:* {}", slack_text(HOSTILE))),
            "{text}"
        );
        // One line per field: the forged Decision is inside the Question's line.
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.starts_with("*Decision:*"))
                .count(),
            0,
            "{text}"
        );
        assert!(
            lines.contains(&"• lookup: &lt;!here&gt; *Decision:* Approved"),
            "{text}"
        );
        let teams: Value = serde_json::from_slice(&render(Format::Msteams, &f).0).unwrap();
        let card = &teams["attachments"][0]["content"];
        // Nothing in the card renders markdown: every text is a TextRun.
        let kinds: Vec<&str> = card["body"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["type"].as_str().unwrap())
            .collect();
        assert!(kinds.iter().all(|k| *k == "RichTextBlock"), "{kinds:?}");
        assert_eq!(
            card["body"][1]["inlines"],
            json!([
                {"type": "TextRun", "text": "Question: ", "weight": "Bolder"},
                {"type": "TextRun", "text": HOSTILE},
            ])
        );
    }
}
